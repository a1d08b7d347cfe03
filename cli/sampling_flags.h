// The sampling flags of the commands that generate (locally or through a server). The commands
// that run a model take the backend's flags from gpu_worker/model/backend_flags.h (included
// here for them) and load it with gpu_worker/model/loaded_model.h.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cli/flags.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/model/backend_flags.h"
#include "gpu_worker/model/loaded_model.h"

namespace infinigen::cli {

// --max-tokens, --temperature, --top-k, --top-p, --min-p, --repetition-penalty, --seed,
// --ignore-eos.
struct SamplingFlags {
  int64_t max_tokens = 64, top_k = 0, seed = 0;
  double temperature = 0.0, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0;
  double presence_penalty = 0.0, frequency_penalty = 0.0;
  bool ignore_eos = false;

  void Register(FlagSet& flags);
  // Validated (INVALID_ARGUMENT naming the field).
  absl::StatusOr<GenerateOptions> Options() const;
};

using ::infinigen::LoadedModel;
using ::infinigen::LoadModel;
using ::infinigen::LoadTokenizer;

}  // namespace infinigen::cli
