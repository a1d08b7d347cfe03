// The flags that pick the backend a command loads its model onto (gpu_worker/model/
// loaded_model.h), and the sampling flags of the commands that generate (locally or through a
// server).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cli/flags.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/model/loaded_model.h"

namespace infinigen::cli {

// --device, --threads, --cpu-weights, --cpu-kv, --cuda-dtype and --batch-invariant, shared by
// every command that runs the model.
struct BackendFlags : BackendSpec {
  void Register(FlagSet& flags);
};

// --max-tokens, --temperature, --top-k, --top-p, --min-p, --repetition-penalty, --seed,
// --ignore-eos.
struct SamplingFlags {
  int64_t max_tokens = 64, top_k = 0, seed = 0;
  double temperature = 0.0, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0;
  bool ignore_eos = false;

  void Register(FlagSet& flags);
  // Validated (INVALID_ARGUMENT naming the field).
  absl::StatusOr<GenerateOptions> Options() const;
};

using ::infinigen::LoadedModel;
using ::infinigen::LoadModel;
using ::infinigen::LoadTokenizer;

}  // namespace infinigen::cli
