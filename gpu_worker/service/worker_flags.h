// The worker's flags, declared once onto WorkerConfig for infinigen-worker and `infinigen
// serve` (which hosts a worker beside its router): the model and how requests select its K/V,
// and the engine with the KV store's memory. What only a standalone worker has (its port, the
// store's address and transport, TLS) infinigen-worker's main.cc declares itself.
#pragma once

#include <string>

#include "common/flags.h"
#include "gpu_worker/service/worker_runtime.h"

namespace infinigen {

// --model, --sidecar, --policy, --budget, --min-budget-tokens, --alpha, --dense-layers and the
// backend's flags (gpu_worker/model/backend_flags.h).
void RegisterWorkerModelFlags(FlagSet& flags, WorkerConfig& config);

// --max-running, `max_queued_name` (the engine's queue: --max-queued, or in `infinigen serve`,
// whose --max-queued is the router's, --max-queued-worker), --max-queued-prompt-tokens,
// --prefill-budget, --max-sessions, --session-ttl-seconds, --kv-capacity-mb, --kv-pool,
// --kv-pool-tokens, --kv-pool-eviction, --device-memory-mb, --host-memory-mb.
void RegisterWorkerEngineFlags(FlagSet& flags, WorkerConfig& config,
                               const std::string& max_queued_name);

}  // namespace infinigen
