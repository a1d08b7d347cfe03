// infinigen-router: the public front door (infinigen.v1.Generation) over a pool of workers, with
// gRPC health, reflection and Prometheus metrics. SIGTERM/SIGINT drain it: health NOT_SERVING
// (load balancers stop sending), streams in progress finish (up to --drain_seconds), then
// shutdown.
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "common/shutdown_signal.h"
#include "router/router_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "gRPC address to serve on (host:port)");
ABSL_FLAG(std::string, workers, "",
          "comma-separated workers: host:port, or dns:///name:port for every address of a name "
          "(a Kubernetes headless service)");
ABSL_FLAG(std::string, worker_tls_ca, "",
          "reach workers over TLS, trusting this CA (presents --tls_cert when set: mTLS)");
ABSL_FLAG(std::string, tls_cert, "",
          "serve TLS (gRPC, and --http_listen) with this certificate chain (PEM)");
ABSL_FLAG(std::string, tls_key, "", "the private key of --tls_cert (PEM)");
ABSL_FLAG(std::string, tls_client_ca, "", "require client certificates signed by this CA");
ABSL_FLAG(std::string, api_keys_file, "",
          "file with one API key per line; clients send `authorization: Bearer <key>` "
          "(empty: no authentication)");
ABSL_FLAG(int, max_streams_per_key, 0,
          "with --api_keys_file: requests of one key in flight at most (0: no limit)");
ABSL_FLAG(double, requests_per_second_per_key, 0,
          "with --api_keys_file: new requests per second of one key, on average (0: no limit)");
ABSL_FLAG(int, request_burst_per_key, 0,
          "with --requests_per_second_per_key: the burst a key may send at once (0: one "
          "second's worth)");
ABSL_FLAG(int32_t, max_streams, 256, "requests relayed to workers at once");
ABSL_FLAG(int32_t, max_queued, 1024, "requests waiting for a slot before RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, max_new_tokens_limit, 4096, "the most max_new_tokens a request may ask");
ABSL_FLAG(int32_t, default_max_new_tokens, 0,
          "max_new_tokens of requests that give none (0: 256, or max_new_tokens_limit if less)");
ABSL_FLAG(int64_t, max_prompt_tokens, 32768,
          "the most prompt tokens a request may have (0: the workers' model context)");
ABSL_FLAG(int64_t, max_request_bytes, 1 << 20, "the largest request message, in bytes");
ABSL_FLAG(int32_t, max_attempts, 4, "worker failures one request may go through");
ABSL_FLAG(int64_t, resume_wait_ms, 10000,
          "how long a stream under way waits for a worker when none is available (counted from "
          "its first failover)");
ABSL_FLAG(int64_t, health_interval_ms, 1000, "how often workers' health is checked");
ABSL_FLAG(bool, resume_from_store, true,
          "on failover the next worker takes the stream's KV over from the KV store instead of "
          "recomputing it (false: always replay the prompt and the tokens sent)");
ABSL_FLAG(int64_t, stall_when_down_ms, 1000,
          "a stream whose worker fails its health checks and sends nothing for this long moves "
          "to another worker (a frozen or unreachable worker)");
ABSL_FLAG(int64_t, stall_timeout_ms, 30000,
          "a stream that has sent tokens and then nothing for max(this, 20 x its mean time per "
          "token) moves to another worker, even if its worker answers health checks");
ABSL_FLAG(int32_t, metrics_port, 0, "Prometheus metrics on this HTTP port (0: off)");
ABSL_FLAG(std::string, http_listen, "",
          "serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
          "/v1/models, /health) on this host:port too (empty: off)");
ABSL_FLAG(int32_t, http_max_connections, 256, "HTTP connections held at once (more: 503)");
ABSL_FLAG(int32_t, http_idle_timeout_seconds, 60,
          "close an HTTP connection that sends no whole request for this long");
ABSL_FLAG(int64_t, drain_seconds, 30, "how long shutdown lets streams in progress finish");
ABSL_FLAG(bool, check_flags, false, "validate the flags and exit (for deployment checks)");

int main(int argc, char** argv) {
  using namespace infinigen;
  // --help lists this binary's own flags (absl's default matches files named after the binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "router/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage("infinigen-router: the public gRPC API over a pool of workers");
  absl::ParseCommandLine(argc, argv);

  RouterServerConfig config;
  config.listen = absl::GetFlag(FLAGS_listen);
  config.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                absl::GetFlag(FLAGS_tls_client_ca)};
  config.api_keys_file = absl::GetFlag(FLAGS_api_keys_file);
  config.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  config.http_listen = absl::GetFlag(FLAGS_http_listen);
  config.http.max_connections = absl::GetFlag(FLAGS_http_max_connections);
  config.http.idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_http_idle_timeout_seconds));
  RouterOptions& o = config.options;
  o.max_streams = absl::GetFlag(FLAGS_max_streams);
  o.max_queued = absl::GetFlag(FLAGS_max_queued);
  o.key_limits.max_streams = absl::GetFlag(FLAGS_max_streams_per_key);
  o.key_limits.requests_per_second = absl::GetFlag(FLAGS_requests_per_second_per_key);
  o.key_limits.burst = absl::GetFlag(FLAGS_request_burst_per_key);
  o.limits.max_new_tokens_limit = absl::GetFlag(FLAGS_max_new_tokens_limit);
  o.limits.default_max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens);
  o.limits.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  o.limits.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  o.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  o.resume_from_store = absl::GetFlag(FLAGS_resume_from_store);
  o.resume_wait = absl::Milliseconds(absl::GetFlag(FLAGS_resume_wait_ms));
  o.stall.when_down = absl::Milliseconds(absl::GetFlag(FLAGS_stall_when_down_ms));
  o.stall.timeout = absl::Milliseconds(absl::GetFlag(FLAGS_stall_timeout_ms));
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_workers), ',', absl::SkipEmpty())) {
    config.pool.targets.emplace_back(w);
  }
  if (!absl::GetFlag(FLAGS_worker_tls_ca).empty()) {
    config.pool.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                       absl::GetFlag(FLAGS_worker_tls_ca)};
  }
  config.pool.health_interval = absl::Milliseconds(absl::GetFlag(FLAGS_health_interval_ms));
  absl::Status st = o.Validate();
  if (st.ok()) st = config.pool.Validate();
  if (!st.ok()) {
    std::cerr << "infinigen-router: " << st.message() << "\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_check_flags)) return 0;

  auto server = RouterServer::Start(config);
  if (!server.ok()) {
    std::cerr << "infinigen-router: " << server.status().message() << "\n";
    return absl::IsInvalidArgument(server.status()) ? 2 : 1;
  }
  std::cout << "infinigen-router: serving on port " << (*server)->port() << ", "
            << (*server)->available_workers() << " of " << config.pool.targets.size()
            << " worker targets available";
  if ((*server)->http_port() > 0) {
    std::cout << "; HTTP" << (config.tls.cert.empty() ? "" : "S") << " on port "
              << (*server)->http_port();
  }
  std::cout << std::endl;

  WaitForShutdownSignal();
  std::cout << "infinigen-router: draining" << std::endl;
  (*server)->Drain(absl::Seconds(absl::GetFlag(FLAGS_drain_seconds)));
  (*server)->Shutdown(absl::Seconds(2));
  std::cout << "infinigen-router: stopped" << std::endl;
  return 0;
}
