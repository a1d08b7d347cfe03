// infinigen-router: the public front door (infinigen.v1.Generation) over a pool of workers, with
// gRPC health, reflection and Prometheus metrics. SIGTERM/SIGINT drain it: health NOT_SERVING
// (load balancers stop sending), streams in progress finish (up to --drain_seconds), then
// shutdown.
#include <iostream>

#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "common/shutdown_signal.h"
#include "router/router_flags.h"
#include "router/router_server.h"

namespace {

int Fail(absl::string_view what, int code) {
  std::cerr << "infinigen-router: " << what << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace infinigen;
  RouterServerConfig config;
  std::string workers, worker_tls_ca;
  int64_t drain_seconds = 30;
  bool check_flags = false;
  FlagSet flags("infinigen-router", "--workers HOST:PORT[,...] [--listen HOST:PORT] [flags]",
                "The public gRPC API (and the OpenAI-compatible HTTP API) over a pool of "
                "workers.");
  RegisterRouterFlags(flags, config);
  flags.String("workers", &workers,
               "comma-separated workers: host:port, or dns:///name:port for every address of a "
               "name (a Kubernetes headless service)");
  flags.String("worker-tls-ca", &worker_tls_ca,
               "reach workers over TLS, trusting this CA (presents --tls-cert when set: mTLS)");
  flags.Milliseconds("health-interval-ms", &config.pool.health_interval,
                     "how often workers' health is checked");
  flags.Int("health-misses", &config.pool.health_misses,
            "health checks in a row that get no answer within 800 ms before a worker counts as "
            "down and its streams move (a refused or broken check counts at once; 0: never by "
            "timeouts)");
  flags.Int("drain-seconds", &drain_seconds, "how long shutdown lets streams in progress finish");
  flags.Bool("check-flags", &check_flags, "validate the flags and exit (for deployment checks)");
  auto parsed = flags.Parse(argc - 1, argv + 1);
  if (!parsed.ok()) return Fail(parsed.status().message(), 2);
  if (!*parsed) return 0;

  for (absl::string_view w : absl::StrSplit(workers, ',', absl::SkipEmpty())) {
    config.pool.targets.emplace_back(w);
  }
  if (!worker_tls_ca.empty()) config.pool.tls = {config.tls.cert, config.tls.key, worker_tls_ca};
  absl::Status st = config.options.Validate();
  if (st.ok()) st = config.pool.Validate();
  if (!st.ok()) return Fail(st.message(), 2);
  if (check_flags) return 0;

  InstallShutdownSignalHandlers();  // before serving: a SIGTERM from then on drains
  auto server = RouterServer::Start(config);
  if (!server.ok()) {
    return Fail(server.status().message(), absl::IsInvalidArgument(server.status()) ? 2 : 1);
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
  (*server)->Drain(absl::Seconds(drain_seconds));
  (*server)->Shutdown(absl::Seconds(2));
  std::cout << "infinigen-router: stopped" << std::endl;
  return 0;
}
