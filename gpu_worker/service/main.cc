// infinigen-worker: loads a model (and its InfiniGen sidecar), connects to the KV store with the
// configured transport, and serves infinigen.worker.v1.Worker with gRPC health, reflection and
// Prometheus metrics. The port opens once the model is loaded (health SERVING from then on);
// SIGTERM/SIGINT drain it: health NOT_SERVING, new requests UNAVAILABLE, running ones finish
// (up to --drain_seconds), then shutdown.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <iostream>
#include <random>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "cli/loaded_model.h"
#include "gpu_worker/engine/batch_engine.h"
#include "gpu_worker/engine/store_kv_cache.h"
#include "gpu_worker/service/worker_metrics.h"
#include "gpu_worker/service/worker_service.h"
#include "kv_store/client/kv_store_client.h"

ABSL_FLAG(std::string, model, "", "model folder (Hugging Face) or .gguf file");
ABSL_FLAG(std::string, sidecar, "",
          "InfiniGen sidecar from `infinigen prepare` (default: next to the model, if present)");
ABSL_FLAG(std::string, listen, "127.0.0.1:50071", "gRPC address to serve on (host:port)");
ABSL_FLAG(std::string, kv_transport, "in-process",
          "how K/V reach the KV store: in-process (a store inside this worker), grpc, shm, ucx");
ABSL_FLAG(std::string, kv_store, "127.0.0.1:50061", "the KV store's gRPC address");
ABSL_FLAG(int64_t, kv_capacity_mb, 1024, "in-process store: host memory for K/V, in MiB");
ABSL_FLAG(std::string, policy, "auto",
          "default KV selection: auto (infinigen with a sidecar, else full), full, infinigen, "
          "window");
ABSL_FLAG(double, budget, 0.2, "default fraction of stored rows a decode step may read");
ABSL_FLAG(double, alpha, 10.0, "default InfiniGen logit margin");
ABSL_FLAG(int32_t, dense_layers, 2, "leading layers that always attend densely");
ABSL_FLAG(int32_t, max_running, 16, "sequences in the batch at once");
ABSL_FLAG(int32_t, max_queued, 64, "requests waiting for a slot before RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, prefill_budget, 256, "prompt tokens a step may add beside its decodes");
ABSL_FLAG(int64_t, device_memory_mb, 0,
          "device memory for per-sequence state (partial key caches, staging); 0: 90% of what "
          "the backend has free after loading");
ABSL_FLAG(int32_t, default_max_new_tokens, 256, "max_new_tokens of requests that give none");
ABSL_FLAG(int32_t, max_new_tokens_limit, 4096, "the most max_new_tokens a request may ask");
ABSL_FLAG(int64_t, threads, 0, "CPU backend threads (0: all cores)");
ABSL_FLAG(std::string, cpu_weights, "f32", "CPU backend weight storage: f32, bf16, q8");
ABSL_FLAG(int32_t, metrics_port, 0, "Prometheus metrics on this HTTP port (0: off)");
ABSL_FLAG(int64_t, drain_seconds, 10, "how long shutdown lets running requests finish");
ABSL_FLAG(bool, check_flags, false, "validate the flags and exit (for deployment checks)");

namespace {

absl::Notification* g_stop = nullptr;
void OnSignal(int) {
  if (g_stop != nullptr && !g_stop->HasBeenNotified()) g_stop->Notify();
}

int Fail(const std::string& what) {
  std::cerr << "infinigen-worker: " << what << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace infinigen;
  absl::SetProgramUsageMessage("infinigen-worker: serves generations of one model");
  absl::ParseCommandLine(argc, argv);

  EngineConfig engine_config;
  engine_config.max_running = absl::GetFlag(FLAGS_max_running);
  engine_config.max_queued = absl::GetFlag(FLAGS_max_queued);
  engine_config.prefill_budget_tokens = absl::GetFlag(FLAGS_prefill_budget);
  auto transport = ParseTransport(absl::GetFlag(FLAGS_kv_transport));
  SelectionConfig selection;
  selection.budget_fraction = absl::GetFlag(FLAGS_budget);
  selection.alpha = absl::GetFlag(FLAGS_alpha);
  selection.dense_layers = absl::GetFlag(FLAGS_dense_layers);
  const std::string policy = absl::GetFlag(FLAGS_policy);
  cli::BackendFlags backend_flags;
  backend_flags.threads = absl::GetFlag(FLAGS_threads);
  backend_flags.cpu_weights = absl::GetFlag(FLAGS_cpu_weights);
  {
    absl::Status st = engine_config.Validate();
    if (st.ok()) st = transport.status();
    if (st.ok()) st = selection.Validate();
    if (st.ok() && policy != "auto" && policy != "full" && policy != "infinigen" &&
        policy != "window") {
      st = absl::InvalidArgumentError(absl::StrCat(
          "--policy ", policy, ": the worker serves auto, full, infinigen and window"));
    }
    if (st.ok()) st = backend_flags.Options().status();
    if (st.ok() && absl::GetFlag(FLAGS_model).empty()) {
      st = absl::InvalidArgumentError("--model is required");
    }
    if (!st.ok()) {
      std::cerr << "infinigen-worker: " << st.message() << "\n";
      return 2;
    }
  }
  if (absl::GetFlag(FLAGS_check_flags)) return 0;

  const std::string model_path = absl::GetFlag(FLAGS_model);
  auto loaded = cli::LoadModel(model_path, backend_flags);
  if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
  // A model without tokenizer files is served with token ids only.
  std::unique_ptr<Tokenizer> tokenizer;
  if (auto t = cli::LoadTokenizer(*loaded->checkpoint); t.ok()) {
    tokenizer = std::move(*t);
  } else {
    std::cerr << "infinigen-worker: no tokenizer (" << t.status().message()
              << "): prompts must be token ids\n";
  }
  std::unique_ptr<InfinigenSidecar> sidecar;
  {
    std::string path = absl::GetFlag(FLAGS_sidecar);
    const bool given = !path.empty();
    if (!given) path = DefaultSidecarPath(model_path);
    if (given || std::filesystem::exists(path)) {
      auto s = ReadSidecar(path, *loaded->checkpoint);
      if (!s.ok()) return Fail(std::string(s.status().message()));
      sidecar = std::make_unique<InfinigenSidecar>(std::move(*s));
    }
  }
  selection.policy = policy == "auto" ? (sidecar ? "infinigen" : "full") : policy;
  if (selection.policy == "infinigen" && !sidecar) {
    return Fail("--policy infinigen needs a sidecar: run `infinigen prepare --model " + model_path +
                "` or pass --sidecar");
  }

  // The KV store: in this process, or a service reached over gRPC, shm or UCX.
  std::unique_ptr<KvStore> local_store;
  KvClientConfig client_config;
  client_config.transport = *transport;
  client_config.address = absl::GetFlag(FLAGS_kv_store);
  client_config.owner = absl::StrCat("worker-", getpid(), "-", absl::GetFlag(FLAGS_listen));
  if (*transport == KvClientConfig::Transport::kInProcess) {
    KvStoreConfig sc;
    sc.capacity_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_kv_capacity_mb)) << 20;
    sc.shared_memory = false;
    auto s = KvStore::Create(sc);
    if (!s.ok()) return Fail(std::string(s.status().message()));
    local_store = std::move(*s);
    client_config.store = local_store.get();
  }
  auto client = MakeKvStoreClient(client_config);
  if (!client.ok()) return Fail(std::string(client.status().message()));
  StoreKvCacheOptions cache_options;
  cache_options.owner = client_config.owner;
  cache_options.id_base = std::random_device{}() * (uint64_t{1} << 32);
  Model& model = *loaded->model;
  KvCacheShape shape = model.kv_shape();
  {
    // Admission by device memory: what a running sequence keeps on the device per token of its
    // length: InfiniGen's partial keys of every sparse layer, and the two staging buffers of
    // fetched rows (K and V, a budget's share of the rows, two layers in flight).
    const ModelConfig& c = model.config();
    const size_t row = static_cast<size_t>(c.num_kv_heads) * c.head_dim * DTypeSize(shape.dtype);
    size_t per_token = static_cast<size_t>(2 * 2 * row * std::max(0.05, selection.budget_fraction));
    if (sidecar) {
      per_token +=
          static_cast<size_t>(std::max<int64_t>(0, c.num_layers - selection.dense_layers)) *
          c.num_kv_heads * sidecar->partial_dim * sizeof(float);
    }
    engine_config.device_bytes_per_token = per_token;
    const int64_t mb = absl::GetFlag(FLAGS_device_memory_mb);
    engine_config.device_memory_bytes =
        mb > 0 ? static_cast<size_t>(mb) << 20
               : static_cast<size_t>(0.9 * static_cast<double>(loaded->backend->FreeMemory()));
  }
  StoreKvCache cache(*loaded->backend, shape, **client, cache_options);
  BatchEngine engine(model, cache, engine_config);

  WorkerServiceOptions options;
  options.model_name = std::filesystem::path(model_path).filename().string();
  options.kv_transport = absl::GetFlag(FLAGS_kv_transport);
  options.selection = selection;
  options.selection_limits.allowed_policies = {"full", "window"};
  if (sidecar) options.selection_limits.allowed_policies.push_back("infinigen");
  options.default_max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens);
  options.max_new_tokens_limit = absl::GetFlag(FLAGS_max_new_tokens_limit);
  options.engine = engine_config;
  WorkerService service(engine, model, tokenizer.get(), sidecar.get(), options);
  std::unique_ptr<WorkerMetrics> metrics;
  if (absl::GetFlag(FLAGS_metrics_port) > 0) {
    auto m = WorkerMetrics::Start(engine, absl::GetFlag(FLAGS_metrics_port));
    if (!m.ok()) return Fail(std::string(m.status().message()));
    metrics = std::move(*m);
    service.SetLatencyMetrics(metrics->latency());
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail("cannot listen on " + absl::GetFlag(FLAGS_listen));
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  std::cout << "infinigen-worker: serving " << options.model_name << " on port " << port
            << ", KV store " << options.kv_transport
            << (*transport == KvClientConfig::Transport::kInProcess
                    ? std::string(" (in this process)")
                    : " at " + client_config.address)
            << ", policy " << selection.policy << std::endl;

  absl::Notification stop;
  g_stop = &stop;
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  stop.WaitForNotification();
  std::cout << "infinigen-worker: draining" << std::endl;
  server->GetHealthCheckService()->SetServingStatus(false);
  service.SetDraining(true);
  const absl::Time drain_end = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_drain_seconds));
  while (absl::Now() < drain_end) {
    const EngineStats s = engine.Stats();
    if (s.running == 0 && s.queued == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  std::cout << "infinigen-worker: stopped" << std::endl;
  return 0;
}
