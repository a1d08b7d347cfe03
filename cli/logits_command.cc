#include <iostream>

#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/sampling_flags.h"
#include "common/npy.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/kv/backend_kv_cache.h"

namespace infinigen::cli {

int RunLogits(int argc, char** argv) {
  std::string model_path, token_ids, out;
  BackendSpec backend;
  FlagSet flags("infinigen logits", "--model PATH --token-ids 1,2,3 --out FILE.npy",
                "Runs the tokens through the model in one pass and writes the final logits at "
                "every position as a float32 .npy of shape [num_tokens, vocab_size].");
  flags.String("model", &model_path, "model folder (config.json + safetensors) or .gguf file");
  flags.String("token-ids", &token_ids, "comma-separated token ids");
  flags.String("out", &out, "output .npy file");
  RegisterBackendFlags(flags, backend);
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("logits", parsed.status());
  if (!*parsed) return 0;
  for (auto [name, value] :
       {std::pair{"model", &model_path}, {"token-ids", &token_ids}, {"out", &out}}) {
    if (value->empty()) {
      return ReportError("logits",
                         absl::InvalidArgumentError(absl::StrCat("--", name, " is required")));
    }
  }
  auto ids = ParseIdList(token_ids, "token-ids");
  if (!ids.ok()) return ReportError("logits", ids.status());
  auto loaded = LoadModel(model_path, backend);
  if (!loaded.ok()) return ReportError("logits", loaded.status());
  Model& model = *loaded->model;
  const int64_t n = static_cast<int64_t>(ids->size());
  const int64_t vocab = model.config().vocab_size;
  if (n > model.config().max_position_embeddings) {
    return ReportError("logits", absl::InvalidArgumentError(
                                     absl::StrCat(n, " tokens exceed the model's context of ",
                                                  model.config().max_position_embeddings)));
  }
  BackendKvCache cache(model.backend(), model.kv_shape());
  if (auto st = cache.Open(1, n); !st.ok()) return ReportError("logits", st);
  std::vector<float> logits(static_cast<size_t>(n * vocab));
  ForwardChunk chunk{1, 0, *ids, /*all_logits=*/true};
  if (auto st = DecodeStep(model, cache).Forward({&chunk, 1}, logits); !st.ok()) {
    return ReportError("logits", st);
  }
  if (auto st = WriteNpyF32(out, {n, vocab}, logits.data()); !st.ok()) {
    return ReportError("logits", st);
  }
  return 0;
}

}  // namespace infinigen::cli
