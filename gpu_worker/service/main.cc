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

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc/health.h"
#include "common/grpc/tls.h"
#include "common/shutdown_signal.h"
#include "gpu_worker/service/loading_gate.h"
#include "gpu_worker/service/worker_metrics.h"
#include "gpu_worker/service/worker_runtime.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"

ABSL_FLAG(std::string, model, "", "model folder (Hugging Face) or .gguf file");
ABSL_FLAG(std::string, sidecar, "",
          "InfiniGen sidecar from `infinigen prepare` (default: next to the model, if present)");
ABSL_FLAG(std::string, listen, "127.0.0.1:50071", "gRPC address to serve on (host:port)");
ABSL_FLAG(std::string, kv_transport, "in-process",
          "how K/V reach the KV store: in-process (a store inside this worker), grpc, shm, ucx");
ABSL_FLAG(std::string, kv_store, "127.0.0.1:50061", "the KV store's gRPC address");
ABSL_FLAG(std::string, kv_store_tls_ca, "",
          "reach the KV store over TLS, trusting this CA (presents --tls_cert when set: mTLS)");
ABSL_FLAG(int64_t, kv_capacity_mb, 1024, "in-process store: host memory for K/V, in MiB");
ABSL_FLAG(int32_t, kv_append_linger_ms, 5,
          "grpc, shm, ucx: a step's appends wait up to this long to travel to the store in one "
          "call (they go at once when a read needs them; 0: every append at once)");
ABSL_FLAG(bool, kv_device_gather, true,
          "--device cuda over in-process or shm: register the store's memory with the GPU and "
          "gather prefetched rows there by address (false: the store copies them into staging "
          "that is then copied to the GPU; 6.5x slower measured on an H200, docs/cuda.md)");
ABSL_FLAG(double, kv_pool, 0.0,
          "KV pool: a sequence keeps at most this fraction of its prompt + max new tokens in the "
          "store; decode tokens past it evict its least useful ones (0: no pool; a longer prompt "
          "is kept whole)");
ABSL_FLAG(int64_t, kv_pool_tokens, 0, "KV pool: a share of this many tokens per sequence instead");
ABSL_FLAG(std::string, kv_pool_eviction, "counter", "KV pool eviction: counter, fifo, lru");
ABSL_FLAG(std::string, policy, "auto",
          "default KV selection: auto (infinigen with a sidecar, else full), full, infinigen, "
          "window");
ABSL_FLAG(double, budget, 0.2, "default fraction of stored rows a decode step may read");
ABSL_FLAG(int64_t, min_budget_tokens, 256,
          "a decode step reads at least this many rows: shorter sequences attend densely");
ABSL_FLAG(double, alpha, 10.0, "default InfiniGen logit margin");
ABSL_FLAG(int32_t, dense_layers, 2, "leading layers that always attend densely");
ABSL_FLAG(int32_t, max_running, 16, "sequences in the batch at once");
ABSL_FLAG(int32_t, max_queued, 64, "requests waiting for a slot before RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_queued_prompt_tokens, 0,
          "prompt tokens of the waiting requests at most; more: RESOURCE_EXHAUSTED (0: no limit)");
ABSL_FLAG(int32_t, max_sessions, 64,
          "conversations (session_id) whose KV stays in the store between requests, so the next "
          "turn prefills only its new tokens (0: none; least recently used closed first)");
ABSL_FLAG(int64_t, session_ttl_seconds, 600, "how long an idle conversation's KV is kept");
ABSL_FLAG(int64_t, prefill_budget, 256, "prompt tokens a step may add beside its decodes");
ABSL_FLAG(int64_t, device_memory_mb, 0,
          "device memory for per-sequence state (partial key caches, staging); 0: 90% of what "
          "the backend has free after loading");
ABSL_FLAG(int32_t, default_max_new_tokens, 0,
          "max_new_tokens of requests that give none (0: 256, or max_new_tokens_limit if less)");
ABSL_FLAG(int32_t, max_new_tokens_limit, 4096, "the most max_new_tokens a request may ask");
ABSL_FLAG(int64_t, max_prompt_tokens, 0, "the most prompt tokens a request may have (0: context)");
ABSL_FLAG(int64_t, threads, 0, "CPU backend threads (0: all cores)");
ABSL_FLAG(std::string, cpu_weights, "f32",
          "CPU backend weight storage: f32, bf16, q8 or q4_1 (a GGUF file's Q4_0/Q4_1/Q4_K "
          "matrices as they are, the others q8)");
ABSL_FLAG(std::string, cpu_kv, "f32",
          "CPU backend K/V storage: f32 (exact) or bf16 (half the bytes)");
ABSL_FLAG(bool, batch_invariant, true,
          "CPU: a sequence's logits do not depend on the sequences batched with it (false: "
          "OpenBLAS for prefill, faster, batch-dependent rounding)");
ABSL_FLAG(std::string, device, "cpu", "where the model runs: cpu or cuda (GPU 0)");
ABSL_FLAG(std::string, cuda_dtype, "bf16",
          "GPU storage of activations, weights and K/V: bf16, f16, f32");
ABSL_FLAG(std::string, tls_cert, "", "serve TLS with this certificate chain (PEM)");
ABSL_FLAG(std::string, tls_key, "", "the private key of --tls_cert (PEM)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "require client certificates signed by this CA (mTLS: only the router gets in)");
ABSL_FLAG(int32_t, metrics_port, 0, "Prometheus metrics on this HTTP port (0: off)");
ABSL_FLAG(int64_t, drain_seconds, 10, "how long shutdown lets running requests finish");
ABSL_FLAG(bool, check_flags, false, "validate the flags and exit (for deployment checks)");
ABSL_FLAG(int32_t, hold_loading_ms, 0,
          "wait this long after the port opens before loading the model (tests and probe drills "
          "of the loading phase)");

namespace {

int Fail(absl::string_view what, int code = 1) {
  std::cerr << "infinigen-worker: " << what << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace infinigen;
  // --help lists this binary's own flags (absl's default matches files named after the binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "gpu_worker/service/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage("infinigen-worker: serves generations of one model");
  absl::ParseCommandLine(argc, argv);

  WorkerConfig config;
  config.model = absl::GetFlag(FLAGS_model);
  config.sidecar = absl::GetFlag(FLAGS_sidecar);
  config.kv_transport = absl::GetFlag(FLAGS_kv_transport);
  config.kv_store = absl::GetFlag(FLAGS_kv_store);
  config.kv_store_tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                         absl::GetFlag(FLAGS_kv_store_tls_ca)};
  if (config.kv_store_tls.ca.empty()) config.kv_store_tls = {};
  config.kv_capacity_mb = absl::GetFlag(FLAGS_kv_capacity_mb);
  config.kv_append_linger_ms = absl::GetFlag(FLAGS_kv_append_linger_ms);
  config.kv_device_gather = absl::GetFlag(FLAGS_kv_device_gather);
  config.kv_pool = absl::GetFlag(FLAGS_kv_pool);
  config.kv_pool_tokens = absl::GetFlag(FLAGS_kv_pool_tokens);
  config.kv_pool_eviction = absl::GetFlag(FLAGS_kv_pool_eviction);
  {
    // The store's lease holder: unique per process even across pods, where pid and --listen
    // are often the same (pid 1, 0.0.0.0:port): a shared name would let one pod's renewals keep
    // a dead pod's sequences alive.
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    std::random_device rd;
    config.owner = absl::StrCat("worker-", host, "-", getpid(), "-", absl::GetFlag(FLAGS_listen),
                                "-", absl::Hex(static_cast<uint64_t>(rd()) << 32 | rd()));
  }
  config.policy = absl::GetFlag(FLAGS_policy);
  config.budget = absl::GetFlag(FLAGS_budget);
  config.min_budget_tokens = absl::GetFlag(FLAGS_min_budget_tokens);
  config.alpha = absl::GetFlag(FLAGS_alpha);
  config.dense_layers = absl::GetFlag(FLAGS_dense_layers);
  config.engine.max_running = absl::GetFlag(FLAGS_max_running);
  config.engine.max_queued = absl::GetFlag(FLAGS_max_queued);
  config.engine.max_queued_prompt_tokens = absl::GetFlag(FLAGS_max_queued_prompt_tokens);
  config.engine.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  config.engine.session_ttl = absl::Seconds(absl::GetFlag(FLAGS_session_ttl_seconds));
  config.engine.prefill_budget_tokens = absl::GetFlag(FLAGS_prefill_budget);
  config.device_memory_mb = absl::GetFlag(FLAGS_device_memory_mb);
  config.limits.default_max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens);
  config.limits.max_new_tokens_limit = absl::GetFlag(FLAGS_max_new_tokens_limit);
  config.limits.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  config.backend.threads = absl::GetFlag(FLAGS_threads);
  config.backend.cpu_weights = absl::GetFlag(FLAGS_cpu_weights);
  config.backend.batch_invariant = absl::GetFlag(FLAGS_batch_invariant);
  config.backend.cpu_kv = absl::GetFlag(FLAGS_cpu_kv);
  config.backend.device = absl::GetFlag(FLAGS_device);
  config.backend.cuda_dtype = absl::GetFlag(FLAGS_cuda_dtype);
  if (auto st = config.Validate(); !st.ok()) return Fail(st.message(), 2);
  if (absl::GetFlag(FLAGS_check_flags)) return 0;
  auto credentials =
      MakeServerCredentials({absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                             absl::GetFlag(FLAGS_tls_client_ca)});
  if (!credentials.ok()) return Fail(credentials.status().message(), 2);

  // The port opens first, so that probes see NOT_SERVING (not a refused connection) while the
  // model loads, which can take minutes for a large checkpoint.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  LoadingGate gate;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), *credentials, &port);
  builder.RegisterService(&gate);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0)
    return Fail("cannot listen on " + absl::GetFlag(FLAGS_listen));
  infinigen::SetHealth(*server, {infinigen::worker::v1::Worker::service_full_name()}, false);
  std::cout << "infinigen-worker: port " << port << " open, loading " << config.model << std::endl;
  std::this_thread::sleep_for(std::chrono::milliseconds(absl::GetFlag(FLAGS_hold_loading_ms)));

  auto runtime = WorkerRuntime::Create(config);
  if (!runtime.ok()) return Fail(runtime.status().message());
  WorkerRuntime& worker = **runtime;
  std::unique_ptr<WorkerMetrics> metrics;
  if (absl::GetFlag(FLAGS_metrics_port) > 0) {
    auto m = WorkerMetrics::Start(worker.engine(), absl::GetFlag(FLAGS_metrics_port));
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
  worker.Drain(absl::Seconds(absl::GetFlag(FLAGS_drain_seconds)));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  std::cout << "infinigen-worker: stopped" << std::endl;
  return 0;
}
