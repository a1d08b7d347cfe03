// infinigen serve: the all-in-one server. The router, one worker and the KV store run in this
// process with the same classes as the split deployment, wired without sockets: the store is
// reached through the in-process transport and the router reaches the worker through an
// in-process gRPC channel. One port serves the public API (infinigen.v1.Generation).
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include <iostream>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/grpc/health.h"
#include "common/shutdown_signal.h"
#include "gpu_worker/service/worker_flags.h"
#include "gpu_worker/service/worker_metrics.h"
#include "gpu_worker/service/worker_runtime.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"
#include "router/router_flags.h"
#include "router/router_server.h"

namespace infinigen::cli {
int RunServe(int argc, char** argv) {
  WorkerConfig worker;
  RouterServerConfig router;
  int worker_metrics_port = 0;
  int64_t drain_seconds = 10;
  bool check_flags = false;
  // The embedded default serves q4_1 weights (a GGUF file's 4- and 5-bit matrices' values as
  // they are, the others q8) and bf16 K/V: the fastest CPU storage, WikiText-2 perplexity 16.4034
  // against transformers' 16.4032 on SmolLM2's Q4_1 file (q8: 16.43; docs/model.md), bf16 K/V
  // +0.01% (docs/accuracy.md). The standalone worker keeps f32 (exact).
  worker.backend.cpu_weights = "q4_1";
  worker.backend.cpu_kv = "bf16";
  FlagSet flags("infinigen serve", "--model PATH [--listen 127.0.0.1:50051]",
                "Serves the public API (infinigen.v1.Generation) with the router, a worker and "
                "the KV store in this process. Stop with Ctrl-C or SIGTERM (running requests "
                "finish first). The router's and the worker's flags are theirs "
                "(infinigen-router, infinigen-worker), but for the worker's queue: "
                "--max-queued-worker.");
  // One set of request limits, the router's, which the worker takes too (below).
  RegisterRouterFlags(flags, router);
  RegisterWorkerModelFlags(flags, worker);
  RegisterWorkerEngineFlags(flags, worker, "max-queued-worker");
  flags.Int("worker-metrics-port", &worker_metrics_port,
            "worker metrics (Prometheus) on this port (0: off)");
  flags.Int("drain-seconds", &drain_seconds, "how long shutdown lets running requests finish");
  flags.Bool("check-flags", &check_flags,
             "validate the flags and exit without loading the model (for deployment checks)");
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("serve", parsed.status());
  if (!*parsed) return 0;

  worker.kv_transport = "in-process";
  worker.owner = "serve-" + std::to_string(getpid());
  worker.limits = router.options.limits;
  if (auto st = worker.Validate(); !st.ok()) return ReportError("serve", st);
  if (auto st = router.options.Validate(); !st.ok()) return ReportError("serve", st);
  if (check_flags) return 0;

  auto runtime = WorkerRuntime::Create(worker);
  if (!runtime.ok()) return ReportError("serve", runtime.status());
  std::unique_ptr<WorkerMetrics> worker_metrics;
  if (worker_metrics_port > 0) {
    auto m = WorkerMetrics::Start((*runtime)->engine(), worker_metrics_port);
    if (!m.ok()) return ReportError("serve", m.status());
    worker_metrics = std::move(*m);
    (*runtime)->service().SetLatencyMetrics(worker_metrics->latency());
  }

  // The worker behind an in-process channel: no port, the router's calls stay in memory.
  grpc::ServerBuilder builder;
  AddHealthService(builder);
  builder.RegisterService(&(*runtime)->service());
  InstallShutdownSignalHandlers();  // before serving: a SIGTERM from then on drains
  std::unique_ptr<grpc::Server> internal = builder.BuildAndStart();
  if (internal == nullptr) {
    return ReportError("serve", absl::InternalError("cannot start the in-process worker server"));
  }
  SetHealth(*internal, {worker::v1::Worker::service_full_name()}, true);
  router.pool.channels.emplace_back("in-process",
                                    internal->InProcessChannel(grpc::ChannelArguments()));
  // The in-process worker lives as long as the router: a late health answer means busy cores,
  // and counting it down would only refuse requests (there is no other worker to move to).
  router.pool.health_misses = 0;
  auto server = RouterServer::Start(router);
  if (!server.ok()) return ReportError("serve", server.status());
  std::cout << "infinigen serve: serving " << (*runtime)->description() << " on port "
            << (*server)->port();
  if ((*server)->http_port() > 0) {
    std::cout << ", HTTP" << (router.tls.cert.empty() ? "" : "S") << " on port "
              << (*server)->http_port();
  }
  std::cout << std::endl;

  WaitForShutdownSignal();
  std::cout << "infinigen serve: draining" << std::endl;
  (*server)->Drain(absl::Seconds(drain_seconds));
  (*server)->Shutdown(absl::Seconds(2));
  internal->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  std::cout << "infinigen serve: stopped" << std::endl;
  return 0;
}

}  // namespace infinigen::cli
