// The flags that choose a model's backend (BackendSpec): --device, --threads, --pin-threads,
// --cpu-weights, --cpu-kv, --cuda-dtype, --batch-invariant, declared once for infinigen-worker,
// `infinigen serve` and the CLI's commands that run a model (each sets its own defaults first).
#pragma once

#include "common/flags.h"
#include "gpu_worker/model/loaded_model.h"

namespace infinigen {

void RegisterBackendFlags(FlagSet& flags, BackendSpec& spec);

}  // namespace infinigen
