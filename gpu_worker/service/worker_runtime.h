// One worker's parts, assembled from a validated config: the model on its backend, tokenizer,
// InfiniGen sidecar, the KV store (inside this process or reached over gRPC, shm or UCX), the
// store-backed KV cache, the batching engine and the Worker gRPC service over them.
// infinigen-worker serves it on its own port; `infinigen serve` wires it to the router in the
// same process.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/tls_files.h"
#include "gpu_worker/engine/batch_engine.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "gpu_worker/model/loaded_model.h"
#include "gpu_worker/service/worker_service.h"
#include "kv_store/client/kv_store_client.h"

namespace infinigen {

struct WorkerConfig {
  std::string model;    // Hugging Face folder or .gguf file
  std::string sidecar;  // empty: next to the model, if present
  std::string kv_transport = "in-process";
  std::string kv_store = "127.0.0.1:50061";
  TlsFiles kv_store_tls;            // the store's control plane
  int64_t kv_capacity_mb = 1024;    // in-process store
  int32_t kv_append_linger_ms = 5;  // KvClientConfig::append_linger
  // KvClientConfig::call_timeout: a call to the KV store (an append batch, a gather, a control
  // call) not answered in this long fails; a decode step waits for its rows up to 2.5 times it.
  int32_t kv_call_timeout_ms = 2000;
  bool kv_device_gather = true;  // StoreKvCacheOptions::device_reads_mapped_rows
  // With InfiniGen on a GPU: its dense layers' K/V also kept on the device
  // (StoreKvCacheOptions::device_resident_layers = the selection's dense_layers).
  bool kv_resident_dense_layers = true;
  // With InfiniGen where the GPU gathers from the store's memory, or a transport copies rows:
  // each sequence keeps the rows of its last prefetch of every layer in backend memory, and a
  // prefetch moves only the others (StoreKvCacheOptions::reuse_rows, sized by ReuseRowsFor).
  bool kv_row_reuse = true;
  // With row reuse where the GPU gathers by block table: the kept rows planned on the device
  // (StoreKvCacheOptions::plan_on_device), so that InfiniGen's decode steps read no choice on
  // the host and wait once a step, not once a layer.
  bool kv_device_plan = true;
  // The KV pool (StoreKvCacheOptions::pool): a sequence's share of tokens in the store,
  // kv_pool_tokens when > 0, else kv_pool x (prompt + max new tokens); both 0: no pool.
  double kv_pool = 0.0;
  int64_t kv_pool_tokens = 0;
  std::string kv_pool_eviction = "counter";  // counter, fifo, lru
  std::string owner = "worker";              // lease holder name at the store
  std::string policy = "auto";               // auto, full, infinigen, window
  double budget = 0.2;
  int64_t min_budget_tokens = 256;  // shorter sequences attend densely
  double alpha = 10.0;
  int32_t dense_layers = 2;
  EngineConfig engine;
  int64_t device_memory_mb = 0;  // 0: 90% of the backend's free memory
  int64_t host_memory_mb = 0;    // 0: host memory is not admitted
  RequestLimits limits = WorkerRequestLimits();
  BackendSpec backend;

  // INVALID_ARGUMENT naming the flag for anything out of range (no files are read).
  absl::Status Validate() const;
  // The requests' default KV selection; `auto` resolves to infinigen with a sidecar, else full.
  SelectionConfig Selection(bool have_sidecar) const;
};

// Row reuse's rows per (layer, KV head) for `selection` (StoreKvCacheOptions::reuse_rows): the
// most an InfiniGen prefetch lists for a sequence of that capacity, its budget and margin.
std::function<int64_t(int64_t)> ReuseRowsFor(const SelectionConfig& selection);

class WorkerRuntime {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerRuntime>> Create(const WorkerConfig& config);
  ~WorkerRuntime();

  WorkerService& service() { return *service_; }
  BatchEngine& engine() { return *engine_; }
  const Model& model() const { return *loaded_.model; }
  // "SmolLM2 (policy infinigen, KV store shm at 127.0.0.1:50061)", for the start-up line.
  const std::string& description() const { return description_; }

  // New requests get UNAVAILABLE; waits up to `timeout` for running and queued ones to finish.
  void Drain(absl::Duration timeout);

 private:
  WorkerRuntime() = default;

  LoadedModel loaded_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<InfinigenSidecar> sidecar_;
  std::unique_ptr<KvStore> local_store_;
  std::unique_ptr<KvStoreClient> client_;
  std::unique_ptr<StoreKvCache> cache_;
  std::unique_ptr<BatchEngine> engine_;
  std::unique_ptr<WorkerService> service_;
  std::string description_;
};

}  // namespace infinigen
