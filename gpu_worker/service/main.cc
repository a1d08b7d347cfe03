// infinigen-worker: loads a model (and its InfiniGen sidecar), connects to the KV store with the
// configured transport, and serves infinigen.worker.v1.Worker with gRPC health, reflection and
// Prometheus metrics. The port opens at once: health NOT_SERVING and calls UNAVAILABLE while the
// model loads, SERVING from then on. SIGTERM/SIGINT drain it: health NOT_SERVING, new requests
// UNAVAILABLE, running ones finish (up to --drain_seconds), then shutdown.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "common/grpc/health.h"
#include "common/grpc/listen.h"
#include "common/grpc/tls.h"
#include "common/shutdown_signal.h"
#include "frontend/limit_flags.h"
#include "gpu_worker/service/loading_gate.h"
#include "gpu_worker/service/worker_flags.h"
#include "gpu_worker/service/worker_metrics.h"
#include "gpu_worker/service/worker_runtime.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"

namespace {

int Fail(absl::string_view what, int code = 1) {
  std::cerr << "infinigen-worker: " << what << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace infinigen;
  WorkerConfig config;
  std::string listen = "127.0.0.1:50071", kv_store_tls_ca;
  TlsFiles tls;
  int metrics_port = 0;
  int64_t drain_seconds = 10, hold_loading_ms = 0;
  bool check_flags = false;
  FlagSet flags("infinigen-worker", "--model PATH [--listen HOST:PORT] [flags]",
                "Serves generations of one model (infinigen.worker.v1.Worker) over the KV store.");
  RegisterWorkerModelFlags(flags, config);
  RegisterWorkerEngineFlags(flags, config, "max-queued");
  RegisterRequestLimitFlags(flags, config.limits, /*with_request_bytes=*/false);
  flags.String("listen", &listen, "gRPC address to serve on (host:port)");
  flags.String("kv-transport", &config.kv_transport,
               "how K/V reach the KV store: in-process (a store inside this worker), grpc, shm, "
               "ucx");
  flags.String("kv-store", &config.kv_store, "the KV store's gRPC address");
  flags.String("kv-store-tls-ca", &kv_store_tls_ca,
               "reach the KV store over TLS, trusting this CA (presents --tls-cert when set: "
               "mTLS)");
  flags.Int("kv-append-linger-ms", &config.kv_append_linger_ms,
            "grpc, shm, ucx: a step's appends wait up to this long to travel to the store in one "
            "call (they go at once when a read needs them; 0: every append at once)");
  flags.Int("kv-call-timeout-ms", &config.kv_call_timeout_ms,
            "grpc, shm, ucx: a call to the KV store (an append batch, a gather, a control call) "
            "that is not answered in this long fails, and so do the sequences it was for (the "
            "router moves their streams); raise it for a store over a slow or loaded link");
  flags.Bool("kv-device-gather", &config.kv_device_gather,
             "--device cuda over in-process or shm: register the store's memory with the GPU and "
             "gather prefetched rows there by address (false: the store copies them into "
             "staging that is then copied to the GPU; 6.5x slower measured on an H200, "
             "docs/cuda.md)");
  flags.Bool("kv-row-reuse", &config.kv_row_reuse,
             "InfiniGen on --device cuda with --kv-device-gather, or over --kv-transport grpc or "
             "ucx: keep each sequence's last prefetched rows of every layer in the backend's "
             "memory, so that a prefetch moves only the rows the last one did not (no KV pool; "
             "docs/worker.md)");
  flags.Bool("kv-device-plan", &config.kv_device_plan,
             "With --kv-row-reuse where the GPU gathers from the store's memory: plan the kept "
             "rows on the GPU, so that InfiniGen's decode steps read no choice on the host and "
             "wait once a step instead of once a layer (false: the host plans them; "
             "docs/worker.md)");
  flags.Bool("kv-resident-dense-layers", &config.kv_resident_dense_layers,
             "--device cuda with InfiniGen: keep its dense layers' K/V on the GPU as well as in "
             "the store, so that their every-row reads cross no link (no KV pool)");
  flags.String("tls-cert", &tls.cert, "serve TLS with this certificate chain (PEM)");
  flags.String("tls-key", &tls.key, "the private key of --tls-cert (PEM)");
  flags.String("tls-client-ca", &tls.ca,
               "require client certificates signed by this CA (mTLS: only the router gets in)");
  flags.Int("metrics-port", &metrics_port, "Prometheus metrics on this HTTP port (0: off)");
  flags.Int("drain-seconds", &drain_seconds, "how long shutdown lets running requests finish");
  flags.Bool("check-flags", &check_flags, "validate the flags and exit (for deployment checks)");
  flags.Int("hold-loading-ms", &hold_loading_ms,
            "wait this long after the port opens before loading the model (tests and probe "
            "drills of the loading phase)");
  auto parsed = flags.Parse(argc - 1, argv + 1);
  if (!parsed.ok()) return Fail(parsed.status().message(), 2);
  if (!*parsed) return 0;

  if (!kv_store_tls_ca.empty()) config.kv_store_tls = {tls.cert, tls.key, kv_store_tls_ca};
  {
    // The store's lease holder: unique per process even across pods, where pid and --listen
    // are often the same (pid 1, 0.0.0.0:port): a shared name would let one pod's renewals keep
    // a dead pod's sequences alive.
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    std::random_device rd;
    config.owner = absl::StrCat("worker-", host, "-", getpid(), "-", listen, "-",
                                absl::Hex(static_cast<uint64_t>(rd()) << 32 | rd()));
  }
  if (auto st = config.Validate(); !st.ok()) return Fail(st.message(), 2);
  if (check_flags) return 0;
  auto credentials = MakeServerCredentials(tls);
  if (!credentials.ok()) return Fail(credentials.status().message(), 2);

  // The port opens first, so that probes see NOT_SERVING (not a refused connection) while the
  // model loads, which can take minutes for a large checkpoint.
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  LoadingGate gate;
  grpc::ServerBuilder builder;
  infinigen::AddHealthService(builder);  // NOT_SERVING from the first probe
  int port = 0;
  infinigen::Listen(builder, listen, *credentials, &port);
  builder.RegisterService(&gate);
  InstallShutdownSignalHandlers();  // before serving: a SIGTERM from then on drains
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return Fail(infinigen::CannotListen(listen));
  infinigen::SetHealth(*server, {infinigen::worker::v1::Worker::service_full_name()}, false);
  std::cout << "infinigen-worker: port " << port << " open, loading " << config.model << std::endl;
  std::this_thread::sleep_for(std::chrono::milliseconds(hold_loading_ms));

  auto runtime = WorkerRuntime::Create(config);
  if (!runtime.ok()) return Fail(runtime.status().message());
  WorkerRuntime& worker = **runtime;
  std::unique_ptr<WorkerMetrics> metrics;
  if (metrics_port > 0) {
    auto m = WorkerMetrics::Start(worker.engine(), metrics_port);
    if (!m.ok()) return Fail(m.status().message());
    metrics = std::move(*m);
    worker.service().SetLatencyMetrics(metrics->latency());
  }
  gate.Open(&worker.service());
  infinigen::SetHealth(*server, {infinigen::worker::v1::Worker::service_full_name()}, true);
  std::cout << "infinigen-worker: serving " << worker.description() << " on port " << port
            << std::endl;

  WaitForShutdownSignal();
  std::cout << "infinigen-worker: draining" << std::endl;
  infinigen::SetHealth(*server, {infinigen::worker::v1::Worker::service_full_name()}, false);
  worker.Drain(absl::Seconds(drain_seconds));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  std::cout << "infinigen-worker: stopped" << std::endl;
  return 0;
}
