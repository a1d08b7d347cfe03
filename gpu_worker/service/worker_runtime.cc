#include "gpu_worker/service/worker_runtime.h"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/selection.h"

namespace infinigen {

absl::Status WorkerConfig::Validate() const {
  IG_RETURN_IF_ERROR(engine.Validate());
  IG_RETURN_IF_ERROR(ParseTransport(kv_transport).status());
  IG_RETURN_IF_ERROR(Selection(false).Validate());
  if (policy != "auto" && policy != "full" && policy != "infinigen" && policy != "window") {
    return absl::InvalidArgumentError(
        absl::StrCat("--policy ", policy, ": the worker serves auto, full, infinigen and window"));
  }
  IG_RETURN_IF_ERROR(backend.Options().status());
  if (model.empty()) return absl::InvalidArgumentError("--model is required");
  if (kv_capacity_mb < 1) return absl::InvalidArgumentError("--kv_capacity_mb must be >= 1");
  if (kv_append_linger_ms < 0 || kv_append_linger_ms > 1000) {
    return absl::InvalidArgumentError("--kv_append_linger_ms must be in [0, 1000]");
  }
  if (kv_call_timeout_ms < 100 || kv_call_timeout_ms > 600000) {
    return absl::InvalidArgumentError(
        "--kv_call_timeout_ms must be in [100, 600000]: how long a call to the KV store may take");
  }
  if (device_memory_mb < 0) return absl::InvalidArgumentError("--device_memory_mb must be >= 0");
  if (host_memory_mb < 0) return absl::InvalidArgumentError("--host_memory_mb must be >= 0");
  if (!(kv_pool >= 0.0 && kv_pool <= 1.0)) {
    return absl::InvalidArgumentError(
        "--kv_pool must be in [0, 1]: a sequence's share of its length kept in the store (0: "
        "no KV pool)");
  }
  if (kv_pool_tokens < 0) return absl::InvalidArgumentError("--kv_pool_tokens must be >= 0");
  if (auto e = ParseEvictionPolicy(kv_pool_eviction); !e.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_pool_eviction: ", e.status().message()));
  }
  return limits.Validate();
}

SelectionConfig WorkerConfig::Selection(bool have_sidecar) const {
  SelectionConfig s;
  s.budget_fraction = budget;
  s.min_budget_tokens = min_budget_tokens;
  s.alpha = alpha;
  s.dense_layers = dense_layers;
  s.policy = policy == "auto" ? (have_sidecar ? PolicyKind::kInfinigen : PolicyKind::kFull)
                              : ParsePolicyKind(policy).value_or(PolicyKind::kFull);
  return s;
}

WorkerRuntime::~WorkerRuntime() {
  // The engine's thread uses the cache, which uses the client: stop them in that order.
  service_.reset();
  engine_.reset();
  cache_.reset();
  client_.reset();
}

std::function<int64_t(int64_t)> ReuseRowsFor(const SelectionConfig& selection) {
  return [selection](int64_t capacity_tokens) {
    // InfiniGen's prefetch of a sequence of `rows` rows lists at most its budget of rows + 1
    // and the margin (InfinigenBackendPolicy::BackendChoiceCapacity).
    const int64_t rows = std::max<int64_t>(capacity_tokens, 0) + 1;
    const int64_t budget = selection.Budget(rows);
    return std::min(rows, budget + cpu::PrefetchMargin(budget));
  };
}

absl::StatusOr<std::unique_ptr<WorkerRuntime>> WorkerRuntime::Create(const WorkerConfig& config) {
  IG_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<WorkerRuntime> w(new WorkerRuntime());
  IG_ASSIGN_OR_RETURN(w->loaded_, LoadModel(config.model, config.backend));
  // A model without tokenizer files is served with token ids only.
  if (auto t = LoadTokenizer(*w->loaded_.checkpoint); t.ok()) {
    w->tokenizer_ = std::move(*t);
  } else {
    std::cerr << "worker: no tokenizer (" << t.status().message()
              << "): prompts must be token ids\n";
  }
  {
    std::string path = config.sidecar;
    const bool given = !path.empty();
    if (!given) path = DefaultSidecarPath(config.model);
    if (given || std::filesystem::exists(path)) {
      IG_ASSIGN_OR_RETURN(InfinigenSidecar s, ReadSidecar(path, *w->loaded_.checkpoint));
      w->sidecar_ = std::make_unique<InfinigenSidecar>(std::move(s));
      IG_RETURN_IF_ERROR(AttachSidecar(*w->loaded_.model, *w->loaded_.checkpoint, *w->sidecar_));
    }
  }
  const SelectionConfig selection = config.Selection(w->sidecar_ != nullptr);
  if (selection.policy == PolicyKind::kInfinigen && !w->sidecar_) {
    return absl::InvalidArgumentError(
        "--policy infinigen needs a sidecar: run `infinigen prepare "
        "--model " +
        config.model + "` or pass --sidecar");
  }

  // The KV store: in this process, or a service reached over gRPC, shm or UCX.
  KvClientConfig client_config;
  client_config.transport = *ParseTransport(config.kv_transport);
  client_config.address = config.kv_store;
  client_config.owner = config.owner;
  client_config.tls = config.kv_store_tls;
  client_config.append_linger = absl::Milliseconds(config.kv_append_linger_ms);
  client_config.call_timeout = absl::Milliseconds(config.kv_call_timeout_ms);
  const bool in_process = client_config.transport == KvClientConfig::Transport::kInProcess;
  if (in_process) {
    KvStoreConfig sc;
    sc.capacity_bytes = static_cast<size_t>(config.kv_capacity_mb) << 20;
    sc.shared_memory = false;
    sc.prefault_ahead_bytes = kServedPrefaultAheadBytes;
    IG_ASSIGN_OR_RETURN(w->local_store_, KvStore::Create(sc));
    client_config.store = w->local_store_.get();
  }
  IG_ASSIGN_OR_RETURN(w->client_, MakeKvStoreClient(client_config));
  StoreKvCacheOptions cache_options;
  cache_options.owner = client_config.owner;
  cache_options.id_base = std::random_device{}() * (uint64_t{1} << 32);
  cache_options.device_reads_mapped_rows = config.kv_device_gather;
  // A gather waits behind the appends it needs and its own call (as the defaults: 5 s, 2 s).
  cache_options.fetch_timeout =
      std::max(cache_options.fetch_timeout, client_config.call_timeout * 5 / 2);
  if (config.kv_pool > 0 || config.kv_pool_tokens > 0) {
    KvPoolConfig pool;
    pool.capacity_fraction = config.kv_pool > 0 ? config.kv_pool : 1.0;
    pool.capacity_tokens = config.kv_pool_tokens;
    pool.eviction = *ParseEvictionPolicy(config.kv_pool_eviction);
    cache_options.pool = pool;
  }
  Model& model = *w->loaded_.model;
  const KvCacheShape shape = model.kv_shape();
  if (config.kv_resident_dense_layers && w->sidecar_ && !w->loaded_.backend->host_accessible() &&
      !cache_options.pool) {
    cache_options.device_resident_layers = selection.dense_layers;
  }
  if (config.kv_row_reuse && selection.policy == PolicyKind::kInfinigen && !cache_options.pool) {
    cache_options.reuse_rows = ReuseRowsFor(selection);
    cache_options.plan_on_device = config.kv_device_plan;
  }
  EngineConfig engine_config = config.engine;
  {
    // Admission by device memory: the engine asks the cache (staging, resident dense layers)
    // and each request's policy (InfiniGen's partial keys) what a sequence holds there
    // (BatchEngine, EngineConfig::device_memory_bytes). The budget: --device_memory_mb or 90% of
    // the free memory, less what the backend takes for scratch of its own (the CUDA GEMM
    // prefill's scores) and the cache for a step's held appends.
    const size_t budget =
        config.device_memory_mb > 0
            ? static_cast<size_t>(config.device_memory_mb) << 20
            : static_cast<size_t>(0.9 * static_cast<double>(w->loaded_.backend->FreeMemory()));
    size_t scratch = w->loaded_.backend->ScratchBytes();
    // A step's held appends (StoreKvCache::BeginAppendStep: its prompt chunks and decodes), in
    // device memory and twice on the host (the pinned copy they come back in, and the rows the
    // store is sent).
    const size_t held =
        cache_options.plan_on_device && !w->loaded_.backend->host_accessible()
            ? StoreKvCache::HeldAppendBytes(
                  shape, engine_config.prefill_budget_tokens + engine_config.max_running)
            : 0;
    scratch += held;
    // The decode attention's workspace for the largest batch (it grows with the batch).
    const ModelConfig& mc = model.config();
    scratch += w->loaded_.backend->DecodeScratchBytes(
        AttentionShape{static_cast<int>(mc.num_heads), static_cast<int>(mc.num_kv_heads),
                       static_cast<int>(mc.head_dim)},
        engine_config.max_running);
    if (config.device_memory_mb > 0 && budget <= scratch) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device_memory_mb ", config.device_memory_mb,
                       " leaves nothing for sequences after ", scratch >> 20,
                       " MiB of the backend's scratch (the prefill's attention scores, a step's "
                       "held appends, the decode attention's partials): raise it "
                       "above that, or 0 for 90% of the free memory"));
    }
    engine_config.device_memory_bytes = budget > scratch ? budget - scratch : 0;
    const size_t host_budget = static_cast<size_t>(config.host_memory_mb) << 20;
    if (host_budget > 0 && host_budget <= 2 * held) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--host-memory-mb ", config.host_memory_mb, " leaves nothing for sequences after ",
          (2 * held) >> 20,
          " MiB for a decode step's held appends (prefill budget + max running tokens of every "
          "layer): raise it, or lower --prefill-budget or --max-running"));
    }
    engine_config.host_memory_bytes = host_budget > 0 ? host_budget - 2 * held : 0;
  }
  w->cache_ =
      std::make_unique<StoreKvCache>(*w->loaded_.backend, shape, *w->client_, cache_options);
  if (!w->cache_->registration_status().ok()) {
    // (Some hosts cannot pin a read-only mapping for the GPU: docs/cuda.md.)
    std::cerr << "worker: the GPU cannot read the KV store's arena where it lies ("
              << w->cache_->registration_status().message()
              << "): prefetched rows are copied through the host instead, and not planned on the "
                 "device\n";
  }
  w->engine_ = std::make_unique<BatchEngine>(model, *w->cache_, engine_config);

  WorkerServiceOptions options;
  options.model_name = std::filesystem::path(config.model).filename().string();
  options.kv_transport = config.kv_transport;
  options.selection = selection;
  options.selection_limits.allowed_policies = {PolicyKind::kFull, PolicyKind::kWindow};
  if (w->sidecar_) options.selection_limits.allowed_policies.push_back(PolicyKind::kInfinigen);
  options.limits = config.limits;
  options.engine = engine_config;
  // InfiniGen chooses on a GPU where it keeps the partial keys by position; a KV pool keeps
  // them by slot, which the host-side policy does (the documented slow path: copies and waits).
  if (w->sidecar_ && !w->loaded_.backend->host_accessible() && !cache_options.pool) {
    IG_ASSIGN_OR_RETURN(options.skew_on_backend,
                        UploadPartialSkew(*w->sidecar_, *w->loaded_.backend));
  }
  w->service_ = std::make_unique<WorkerService>(*w->engine_, model, w->tokenizer_.get(),
                                                w->sidecar_.get(), options);
  std::string pool;
  if (cache_options.pool) {
    pool =
        absl::StrCat(", KV pool of ",
                     config.kv_pool_tokens > 0 ? absl::StrCat(config.kv_pool_tokens, " tokens")
                                               : absl::StrCat(config.kv_pool, " of each sequence"),
                     " evicting by ", config.kv_pool_eviction);
  }
  w->description_ = absl::StrCat(
      options.model_name, " (policy ", PolicyKindName(selection.policy), ", KV store ",
      in_process ? "in this process" : config.kv_transport + " at " + config.kv_store, pool, ")");
  return w;
}

void WorkerRuntime::Drain(absl::Duration timeout) {
  service_->SetDraining(true);
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    const EngineStats s = engine_->Stats();
    if (s.running == 0 && s.queued == 0) return;
    absl::SleepFor(absl::Milliseconds(50));
  }
}

}  // namespace infinigen
