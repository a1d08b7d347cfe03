#include "router/router_flags.h"

#include "frontend/limit_flags.h"

namespace infinigen {

void RegisterRouterFlags(FlagSet& flags, RouterServerConfig& c) {
  flags.String("listen", &c.listen, "gRPC address of the public API (host:port)");
  flags.String("tls-cert", &c.tls.cert,
               "serve TLS (gRPC, and --http-listen) with this certificate chain (PEM)");
  flags.String("tls-key", &c.tls.key, "the private key of --tls-cert (PEM)");
  flags.String("tls-client-ca", &c.tls.ca, "require client certificates signed by this CA");
  flags.String("api-keys-file", &c.api_keys_file,
               "file with one API key per line; clients send `authorization: Bearer <key>` "
               "(empty: no authentication)");
  RouterOptions& o = c.options;
  flags.Int("max-streams-per-key", &o.key_limits.max_streams,
            "with --api-keys-file: requests of one key in flight at most (0: no limit)");
  flags.Float("requests-per-second-per-key", &o.key_limits.requests_per_second,
              "with --api-keys-file: new requests per second of one key, on average (0: no limit)");
  flags.Int("request-burst-per-key", &o.key_limits.burst,
            "with --requests-per-second-per-key: the burst a key may send at once (0: one "
            "second's worth)");
  flags.Int("max-streams", &o.max_streams, "requests served at once");
  flags.Int("max-queued", &o.max_queued, "requests waiting for a slot before RESOURCE_EXHAUSTED");
  RegisterRequestLimitFlags(flags, o.limits, /*with_request_bytes=*/true);
  flags.Int("max-attempts", &o.max_attempts, "worker failures one request may go through");
  flags.Milliseconds("resume-wait-ms", &o.resume_wait,
                     "how long a stream under way waits for a worker when none is available "
                     "(counted from its first failover)");
  flags.Bool("resume-from-store", &o.resume_from_store,
             "on failover the next worker takes the stream's KV over from the KV store instead "
             "of recomputing it (false: always replay the prompt and the tokens sent)");
  flags.Milliseconds("stall-when-down-ms", &o.stall.when_down,
                     "a stream whose worker fails its health checks and sends nothing for this "
                     "long moves to another worker (a frozen or unreachable worker)");
  flags.Milliseconds("stall-timeout-ms", &o.stall.timeout,
                     "a stream that has sent tokens and then nothing for max(this, 20 x its mean "
                     "time per token) moves to another worker, even if its worker answers health "
                     "checks");
  flags.Int("metrics-port", &c.metrics_port, "Prometheus metrics on this HTTP port (0: off)");
  flags.String("http-listen", &c.http_listen,
               "serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
               "/v1/models, /health) on this host:port too (empty: off)");
  flags.Int("http-max-connections", &c.http.max_connections,
            "HTTP connections held at once (more: 503)");
  flags.Seconds("http-idle-timeout-seconds", &c.http.idle_timeout,
                "close an HTTP connection that sends no whole request for this long");
}

}  // namespace infinigen
