#include "gpu_worker/service/worker_flags.h"

#include "gpu_worker/model/backend_flags.h"

namespace infinigen {

void RegisterWorkerModelFlags(FlagSet& flags, WorkerConfig& c) {
  flags.String("model", &c.model, "model folder (Hugging Face) or .gguf file");
  flags.String("sidecar", &c.sidecar,
               "InfiniGen sidecar from `infinigen prepare` (default: next to the model, if "
               "present)");
  flags.String("policy", &c.policy,
               "default KV selection: auto (infinigen with a sidecar, else full), full, "
               "infinigen, window");
  flags.Float("budget", &c.budget, "default fraction of stored rows a decode step may read");
  flags.Int("min-budget-tokens", &c.min_budget_tokens,
            "a decode step reads at least this many rows: shorter sequences attend densely");
  flags.Float("alpha", &c.alpha, "default InfiniGen logit margin");
  flags.Int("dense-layers", &c.dense_layers, "leading layers that always attend densely");
  RegisterBackendFlags(flags, c.backend);
}

void RegisterWorkerEngineFlags(FlagSet& flags, WorkerConfig& c,
                               const std::string& max_queued_name) {
  flags.Int("max-running", &c.engine.max_running, "sequences in the worker's batch at once");
  flags.Int(max_queued_name, &c.engine.max_queued,
            "requests waiting for a batch slot before RESOURCE_EXHAUSTED");
  flags.Int("max-queued-prompt-tokens", &c.engine.max_queued_prompt_tokens,
            "prompt tokens of the waiting requests at most; more: RESOURCE_EXHAUSTED (0: no "
            "limit)");
  flags.Int("prefill-budget", &c.engine.prefill_budget_tokens,
            "prompt tokens a step may add beside its decodes");
  flags.Int("max-sessions", &c.engine.max_sessions,
            "conversations (session_id) whose KV stays in the store between requests, so the "
            "next turn prefills only its new tokens (0: none; least recently used closed first)");
  flags.Seconds("session-ttl-seconds", &c.engine.session_ttl,
                "how long an idle conversation's KV is kept");
  flags.Int("kv-capacity-mb", &c.kv_capacity_mb, "in-process store: host memory for K/V, in MiB");
  flags.Float("kv-pool", &c.kv_pool,
              "KV pool: a sequence keeps at most this fraction of its prompt + max new tokens in "
              "the store; decode tokens past it evict its least useful ones (0: no pool; a longer "
              "prompt is kept whole)");
  flags.Int("kv-pool-tokens", &c.kv_pool_tokens,
            "KV pool: a share of this many tokens per sequence instead");
  flags.String("kv-pool-eviction", &c.kv_pool_eviction, "KV pool eviction: counter, fifo, lru");
  flags.Int("device-memory-mb", &c.device_memory_mb,
            "device memory for per-sequence state (partial key caches, staging) and the "
            "backend's scratch (the CUDA prefill's attention scores, 384 MiB in bf16); 0: 90% of "
            "what the backend has free after loading");
  flags.Int("host-memory-mb", &c.host_memory_mb,
            "host memory for per-sequence state besides the backend's (slot lists, bounce "
            "buffers of a GPU over grpc/ucx, a host InfiniGen policy's partial keys and "
            "positions); requests wait while running ones hold it; 0: no limit");
}

}  // namespace infinigen
