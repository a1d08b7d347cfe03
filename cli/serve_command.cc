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
#include "cli/loaded_model.h"
#include "common/grpc/health.h"
#include "common/shutdown_signal.h"
#include "gpu_worker/service/worker_metrics.h"
#include "gpu_worker/service/worker_runtime.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"
#include "router/router_server.h"

namespace infinigen::cli {
int RunServe(int argc, char** argv) {
  WorkerConfig worker;
  RouterServerConfig router;
  int worker_metrics_port = 0;
  int64_t drain_seconds = 10, http_idle_timeout = 60, session_ttl_seconds = 600;
  bool check_flags = false;
  FlagSet flags("serve", "--model PATH [--listen 127.0.0.1:50051]",
                "Serves the public API (infinigen.v1.Generation) with the router, a worker and "
                "the KV store in this process. Stop with Ctrl-C or SIGTERM (running requests "
                "finish first).");
  flags.String("model", &worker.model, "model folder (Hugging Face) or .gguf file");
  flags.String("sidecar", &worker.sidecar,
               "InfiniGen sidecar (default: next to the model, if present)");
  flags.String("listen", &router.listen, "gRPC address of the public API (host:port)");
  flags.String("policy", &worker.policy,
               "default KV selection: auto (infinigen with a sidecar, else full), full, "
               "infinigen, window");
  flags.Float("budget", &worker.budget, "default fraction of stored rows a decode step reads");
  flags.Int("min-budget-tokens", &worker.min_budget_tokens,
            "a decode step reads at least this many rows: shorter sequences attend densely");
  flags.Float("alpha", &worker.alpha, "default InfiniGen logit margin");
  flags.Int("dense-layers", &worker.dense_layers, "leading layers that always attend densely");
  flags.Int("kv-capacity-mb", &worker.kv_capacity_mb, "host memory for K/V, in MiB");
  flags.Float("kv-pool", &worker.kv_pool,
              "KV pool: a sequence keeps at most this fraction of its prompt + max new tokens; "
              "decode tokens past it evict its least useful ones (0: no pool)");
  flags.Int("kv-pool-tokens", &worker.kv_pool_tokens,
            "KV pool: a share of this many tokens per sequence instead");
  flags.String("kv-pool-eviction", &worker.kv_pool_eviction,
               "KV pool eviction: counter, fifo, lru");
  flags.Int("max-running", &worker.engine.max_running, "sequences in the worker's batch at once");
  flags.Int("max-queued-worker", &worker.engine.max_queued, "requests waiting for a batch slot");
  flags.Int("max-queued-prompt-tokens", &worker.engine.max_queued_prompt_tokens,
            "prompt tokens of the waiting requests at most (0: no limit)");
  flags.Int("prefill-budget", &worker.engine.prefill_budget_tokens,
            "prompt tokens a step may add beside its decodes");
  flags.Int("max-sessions", &worker.engine.max_sessions,
            "conversations (session_id) whose KV is kept between requests");
  flags.Int("session-ttl-seconds", &session_ttl_seconds,
            "how long an idle conversation's KV is kept");
  RequestLimits& limits = router.options.limits;  // the router's and the worker's
  flags.Int("default-max-new-tokens", &limits.default_max_new_tokens,
            "max_new_tokens of requests that give none (0: 256, or the limit if less)");
  flags.Int("max-new-tokens-limit", &limits.max_new_tokens_limit,
            "the most max_new_tokens a request may ask");
  flags.Int("max-prompt-tokens", &limits.max_prompt_tokens,
            "the most prompt tokens a request may have (0: the model's context)");
  flags.Int("max-request-bytes", &limits.max_request_bytes, "largest request message");
  flags.Int("max-streams", &router.options.max_streams, "requests served at once");
  flags.Int("max-queued", &router.options.max_queued,
            "requests waiting for a slot before RESOURCE_EXHAUSTED");
  flags.String("api-keys-file", &router.api_keys_file,
               "file with one API key per line (clients send `authorization: Bearer <key>`)");
  flags.String("tls-cert", &router.tls.cert,
               "serve TLS (gRPC, and --http-listen) with this certificate chain (PEM)");
  flags.String("tls-key", &router.tls.key, "the private key of --tls-cert (PEM)");
  flags.String("tls-client-ca", &router.tls.ca, "require client certificates signed by this CA");
  flags.Int("max-streams-per-key", &router.options.key_limits.max_streams,
            "with --api-keys-file: requests of one key in flight at most (0: no limit)");
  flags.Float("requests-per-second-per-key", &router.options.key_limits.requests_per_second,
              "with --api-keys-file: new requests per second of one key, on average (0: no limit)");
  flags.Int("request-burst-per-key", &router.options.key_limits.burst,
            "with --requests-per-second-per-key: the burst a key may send at once (0: one "
            "second's worth)");
  flags.Int("metrics-port", &router.metrics_port,
            "router metrics (Prometheus) on this port (0: off)");
  flags.String("http-listen", &router.http_listen,
               "also serve the OpenAI-compatible HTTP API (/v1/completions, "
               "/v1/chat/completions, /v1/models, /health) on this host:port (empty: off)");
  flags.Int("http-max-connections", &router.http.max_connections,
            "HTTP connections held at once (more: 503)");
  flags.Int("http-idle-timeout-seconds", &http_idle_timeout,
            "close an HTTP connection that sends no whole request for this long");
  flags.Int("worker-metrics-port", &worker_metrics_port,
            "worker metrics (Prometheus) on this port (0: off)");
  flags.Int("drain-seconds", &drain_seconds, "how long shutdown lets running requests finish");
  flags.Bool("check-flags", &check_flags,
             "validate the flags and exit without loading the model (for deployment checks)");
  // The embedded default serves q4_1 weights (a GGUF file's Q4_0/Q4_1/Q4_K matrices' values as
  // they are, the others q8) and bf16 K/V: the fastest CPU storage, WikiText-2 perplexity 16.4034
  // against transformers' 16.4032 on SmolLM2's Q4_1 file (q8: 16.43; docs/model.md), bf16 K/V
  // +0.01% (docs/accuracy.md). The standalone worker keeps f32 (exact).
  BackendFlags backend;
  backend.cpu_weights = "q4_1";
  backend.cpu_kv = "bf16";
  backend.Register(flags);
  auto parsed = flags.Parse(argc, argv);
  worker.backend = backend;
  if (!parsed.ok()) return ReportError("serve", parsed.status());
  if (!*parsed) return 0;

  worker.kv_transport = "in-process";
  worker.owner = "serve-" + std::to_string(getpid());
  worker.engine.session_ttl = absl::Seconds(session_ttl_seconds);
  worker.limits = limits;
  router.http.idle_timeout = absl::Seconds(http_idle_timeout);
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
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.RegisterService(&(*runtime)->service());
  std::unique_ptr<grpc::Server> internal = builder.BuildAndStart();
  if (internal == nullptr) {
    return ReportError("serve", absl::InternalError("cannot start the in-process worker server"));
  }
  SetHealth(*internal, {worker::v1::Worker::service_full_name()}, true);
  router.pool.channels.emplace_back("in-process",
                                    internal->InProcessChannel(grpc::ChannelArguments()));
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
