#include <cstdio>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/loaded_model.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/engine/resident_kv_cache.h"

namespace infinigen::cli {

int RunGenerate(int argc, char** argv) {
  std::string model_path, prompt_ids;
  int64_t max_tokens = 64, top_k = 0, seed = 0;
  double temperature = 0.0, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0;
  bool ignore_eos = false;
  BackendFlags backend_flags;
  FlagSet flags("generate", "--model PATH --prompt-ids 1,2,3 [flags]",
                "Generates a continuation of a prompt with the model on the CPU and prints the "
                "generated token ids as a JSON array.");
  flags.String("model", &model_path, "model folder (config.json + safetensors) or .gguf file");
  flags.String("prompt-ids", &prompt_ids, "prompt as comma-separated token ids");
  flags.Int("max-tokens", &max_tokens, "most tokens to generate");
  flags.Float("temperature", &temperature, "sampling temperature; 0 = greedy");
  flags.Int("top-k", &top_k, "keep the k most likely tokens (0 = off)");
  flags.Float("top-p", &top_p, "nucleus sampling mass (1 = off)");
  flags.Float("min-p", &min_p, "drop tokens below min-p x the top probability (0 = off)");
  flags.Float("repetition-penalty", &repetition_penalty, "penalty for repeated tokens (1 = off)");
  flags.Int("seed", &seed, "random seed for sampling");
  flags.Bool("ignore-eos", &ignore_eos, "keep generating past end-of-sequence tokens");
  backend_flags.Register(flags);
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("generate", parsed.status());
  if (!*parsed) return 0;
  if (model_path.empty()) {
    return ReportError("generate", absl::InvalidArgumentError("--model is required"));
  }
  if (prompt_ids.empty()) {
    return ReportError("generate", absl::InvalidArgumentError("--prompt-ids is required"));
  }
  auto prompt = ParseIdList(prompt_ids, "prompt-ids");
  if (!prompt.ok()) return ReportError("generate", prompt.status());

  GenerateOptions options;
  options.max_new_tokens = max_tokens;
  options.ignore_eos = ignore_eos;
  options.sampling.temperature = static_cast<float>(temperature);
  options.sampling.top_k = static_cast<int32_t>(top_k);
  options.sampling.top_p = static_cast<float>(top_p);
  options.sampling.min_p = static_cast<float>(min_p);
  options.sampling.repetition_penalty = static_cast<float>(repetition_penalty);
  options.sampling.seed = static_cast<uint64_t>(seed);
  if (auto st = options.Validate(); !st.ok()) return ReportError("generate", st);

  auto loaded = LoadModel(model_path, backend_flags);
  if (!loaded.ok()) return ReportError("generate", loaded.status());
  Model& model = *loaded->model;
  ResidentKvCache cache(model.backend(), model.kv_shape());
  auto result = Generate(model, cache, /*seq=*/1, *prompt, options);
  if (!result.ok()) return ReportError("generate", result.status());

  std::cout << "[" << absl::StrJoin(result->tokens, ",") << "]\n";
  const double decode_tps = result->tokens.size() > 1
                                ? (result->tokens.size() - 1) / result->decode_seconds
                                : 0.0;
  std::cerr << absl::StrCat("prompt ", result->prompt_tokens, " tokens in ",
                            result->prefill_seconds, " s; generated ", result->tokens.size(),
                            " tokens (", FinishReasonName(result->finish_reason), "), ",
                            decode_tps, " tokens/s\n");
  return 0;
}

}  // namespace infinigen::cli
