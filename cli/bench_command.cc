#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <random>

#include "absl/strings/str_format.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/sampling_flags.h"
#include "common/status_macros.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "kernels/cpu/team.h"

namespace infinigen::cli {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double PeakRssMiB() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss / 1024.0;  // ru_maxrss is in KiB on Linux
}

}  // namespace

int RunBench(int argc, char** argv) {
  std::string model_path;
  int64_t prompt_tokens = 512, gen_tokens = 128, repetitions = 3, depth = 0;
  BackendSpec backend;
  FlagSet flags("infinigen bench", "--model PATH [flags]",
                "Measures prefill and decode throughput the way llama-bench does (pp: one "
                "prompt of random tokens; tg: single-token steps; both from an empty cache, or "
                "after --depth tokens already in it), best of the repetitions, and prints one "
                "JSON line with the peak resident memory.");
  flags.String("model", &model_path, "model folder (config.json + safetensors) or .gguf file");
  flags.Int("prompt-tokens", &prompt_tokens, "tokens in the prefill test (0 = skip)");
  flags.Int("gen-tokens", &gen_tokens, "decode steps in the generation test (0 = skip)");
  flags.Int("repetitions", &repetitions, "runs of each test; the best is reported");
  flags.Int("depth", &depth,
            "random tokens in the cache before each test, prefilled untimed (llama-bench's -d: "
            "decode speed at a long context)");
  RegisterBackendFlags(flags, backend);
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("bench", parsed.status());
  if (!*parsed) return 0;
  if (model_path.empty()) {
    return ReportError("bench", absl::InvalidArgumentError("--model is required"));
  }
  if (prompt_tokens < 0 || gen_tokens < 0 || depth < 0 || repetitions < 1) {
    return ReportError("bench", absl::InvalidArgumentError(
                                    "--prompt-tokens, --gen-tokens and --depth must be >= 0, "
                                    "--repetitions >= 1"));
  }
  const double t_load = Now();
  auto loaded = LoadModel(model_path, backend);
  if (!loaded.ok()) return ReportError("bench", loaded.status());
  const double load_seconds = Now() - t_load;
  Model& model = *loaded->model;
  const ModelConfig& c = model.config();
  if (depth + std::max(prompt_tokens, gen_tokens) > c.max_position_embeddings) {
    return ReportError(
        "bench", absl::InvalidArgumentError(absl::StrFormat(
                     "--depth plus the longer test (%d tokens) exceeds the "
                     "model's context of %d tokens",
                     depth + std::max(prompt_tokens, gen_tokens), c.max_position_embeddings)));
  }
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size - 1));
  std::vector<float> logits(c.vocab_size);
  BackendKvCache cache(model.backend(), model.kv_shape());
  DecodeStep step(model, cache);

  // Opens sequence 1 for `extra` tokens after the depth, and prefills the depth (untimed).
  auto open_at_depth = [&](int64_t extra) -> absl::Status {
    IG_RETURN_IF_ERROR(cache.Open(1, depth + extra));
    if (depth == 0) return absl::OkStatus();
    std::vector<int32_t> context(depth);
    for (auto& t : context) t = token(rng);
    ForwardChunk chunk{1, 0, context, false};
    return step.Forward({&chunk, 1}, logits);
  };
  double best_pp = 0, best_tg = 0;
  double tg_jobs = 0;  // the CPU team's jobs (barriers) per decode token
  for (int64_t r = 0; r < repetitions; ++r) {
    if (prompt_tokens > 0) {
      std::vector<int32_t> prompt(prompt_tokens);
      for (auto& t : prompt) t = token(rng);
      if (auto st = open_at_depth(prompt_tokens); !st.ok()) return ReportError("bench", st);
      ForwardChunk chunk{1, depth, prompt, false};
      const double t0 = Now();
      if (auto st = step.Forward({&chunk, 1}, logits); !st.ok()) {
        return ReportError("bench", st);
      }
      best_pp = std::max(best_pp, prompt_tokens / (Now() - t0));
      cache.Close(1);
    }
    if (gen_tokens > 0) {
      if (auto st = open_at_depth(gen_tokens); !st.ok()) return ReportError("bench", st);
      int32_t next = c.bos_token_id >= 0 ? c.bos_token_id : 0;
      const double t0 = Now();
      const uint64_t jobs0 = cpu::Team::Get().jobs();
      for (int64_t pos = depth; pos < depth + gen_tokens; ++pos) {
        ForwardChunk chunk{1, pos, std::span<const int32_t>(&next, 1), false};
        if (auto st = step.Forward({&chunk, 1}, logits); !st.ok()) {
          return ReportError("bench", st);
        }
        next =
            static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      }
      best_tg = std::max(best_tg, gen_tokens / (Now() - t0));
      tg_jobs = static_cast<double>(cpu::Team::Get().jobs() - jobs0) / gen_tokens;
      cache.Close(1);
    }
  }
  std::cout << absl::StrFormat(
      "{\"engine\": \"infinigen\", \"backend\": \"%s\", \"threads\": %d, \"prompt_tokens\": %d, "
      "\"gen_tokens\": %d, \"depth\": %d, \"prefill_tokens_per_s\": %.2f, "
      "\"decode_tokens_per_s\": %.2f, \"team_jobs_per_decode_token\": %.1f, \"load_seconds\": "
      "%.3f, \"peak_rss_mib\": %.1f}\n",
      model.backend().Name(), backend.threads, prompt_tokens, gen_tokens, depth, best_pp, best_tg,
      tg_jobs, load_seconds, PeakRssMiB());
  return 0;
}

}  // namespace infinigen::cli
