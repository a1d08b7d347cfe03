#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/sampling_flags.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/sidecar.h"

namespace infinigen::cli {

std::string DefaultBookPath() {
  std::string cache;
  if (const char* c = std::getenv("INFINIGEN_CACHE"); c != nullptr && *c) {
    cache = c;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x) {
    cache = std::string(x) + "/infinigen";
  } else if (const char* h = std::getenv("HOME"); h != nullptr) {
    cache = std::string(h) + "/.cache/infinigen";
  }
  return cache + "/books/pride_and_prejudice.txt";
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(what, " ", path,
                                            " not found (scripts/setup.sh extracts public-domain "
                                            "books into the cache; or pass a file)"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int RunPrepare(int argc, char** argv) {
  std::string model_path, calibration, out;
  double ratio = 0.0;
  int64_t calibration_tokens = 2048;
  bool no_skew = false;
  bool rope_pairs = true;
  std::string channel_rule = "product";
  BackendSpec backend;
  FlagSet flags("infinigen prepare", "--model PATH [flags]",
                "Computes InfiniGen's skew and partial channels for a model from a dense prefill "
                "of a calibration text and writes them to a sidecar file next to the model.");
  flags.String("model", &model_path, "model folder (config.json + safetensors) or .gguf file");
  flags.Float("ratio", &ratio,
              "partial ratio r: d' = ceil(r x head_dim) channels are kept (default: 26 "
              "channels, the paper's 0.2 x 128, whatever the head size)");
  flags.String("calibration", &calibration,
               "calibration text file (default: Pride and Prejudice, extracted by setup.sh)");
  flags.Int("calibration-tokens", &calibration_tokens,
            "calibration tokens (capped at the model's context)");
  flags.String("out", &out, "sidecar path (default: next to the model)");
  flags.Bool("no-skew", &no_skew, "skip the skew (A = I): the paper's ablation");
  flags.Bool("rope-pairs", &rope_pairs,
             "partial channels as whole RoPE pairs, not skewed, where the model allows (Llama): "
             "the speculation then multiplies only those rows of W_q; false: skewed channels");
  flags.String("channel-rule", &channel_rule,
               "partial channel ranking: product (mean|QA| x mean|KA|, the default) or sum "
               "(Σ|QA| + Σ|KA|, the paper's)");
  RegisterBackendFlags(flags, backend);
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("prepare", parsed.status());
  if (!*parsed) return 0;
  if (model_path.empty()) {
    return ReportError("prepare", absl::InvalidArgumentError("--model is required"));
  }
  if (calibration_tokens < 2) {
    return ReportError("prepare", absl::InvalidArgumentError("--calibration-tokens must be >= 2"));
  }
  if (calibration.empty()) calibration = DefaultBookPath();
  auto text = ReadTextFile(calibration, "calibration text");
  if (!text.ok()) return ReportError("prepare", text.status());
  auto loaded = LoadModel(model_path, backend);
  if (!loaded.ok()) return ReportError("prepare", loaded.status());
  auto tokenizer = LoadTokenizer(*loaded->checkpoint);
  if (!tokenizer.ok()) return ReportError("prepare", tokenizer.status());
  std::vector<int32_t> tokens = (*tokenizer)->Encode(*text, /*add_special=*/true);
  if (static_cast<int64_t>(tokens.size()) > calibration_tokens) tokens.resize(calibration_tokens);

  const bool tty = isatty(STDERR_FILENO);
  PrepareOptions options;
  options.ratio = static_cast<float>(ratio);
  options.skew = !no_skew;
  options.rope_pairs = rope_pairs;
  if (channel_rule != "sum" && channel_rule != "product") {
    return ReportError("prepare",
                       absl::InvalidArgumentError("--channel-rule must be sum or product"));
  }
  options.channel_rule = channel_rule == "sum" ? ChannelRule::kSumAbs : ChannelRule::kProduct;
  auto sidecar =
      PrepareInfinigen(*loaded->model, *loaded->checkpoint, tokens, options,
                       [&](int pass, int64_t done, int64_t total) {
                         if (!tty) return;
                         const int width = 30, filled = static_cast<int>(width * done / total);
                         std::cerr << absl::StrFormat("\rprepare: pass %d/2 [%s%s] %d/%d tokens",
                                                      pass, std::string(filled, '#'),
                                                      std::string(width - filled, '.'), done, total)
                                   << (done == total ? "\n" : "") << std::flush;
                       });
  if (!sidecar.ok()) return ReportError("prepare", sidecar.status());
  if (out.empty()) out = DefaultSidecarPath(model_path);
  if (auto st = WriteSidecar(*sidecar, out); !st.ok()) return ReportError("prepare", st);
  std::cout << absl::StrFormat(
      "wrote %s: ratio %.3f, %d of %d channels per KV head, %s, %d "
      "calibration tokens from %s\n",
      out, sidecar->ratio, sidecar->partial_dim, sidecar->head_dim,
      sidecar->rope_pairs ? "whole RoPE pairs, not skewed"
      : sidecar->skewed   ? "skewed"
                          : "not skewed",
      sidecar->calibration_tokens, calibration);
  return 0;
}

}  // namespace infinigen::cli
