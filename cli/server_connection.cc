#include "cli/server_connection.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace infinigen::cli {

void ConnectionFlags::Register(FlagSet& flags) {
  flags.String("server", &server, "the server's address (host:port)");
  flags.String("api-key", &api_key, "API key (default: $INFINIGEN_API_KEY)");
  flags.String("tls-ca", &tls.ca, "use TLS, trusting this CA (PEM)");
  flags.String("tls-cert", &tls.cert, "client certificate for mTLS (PEM)");
  flags.String("tls-key", &tls.key, "its private key (PEM)");
  flags.Float("wait-seconds", &wait_seconds, "wait this long for the server to be ready");
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectionFlags::Connect() const {
  auto credentials = MakeChannelCredentials(tls, "--tls-");
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(server, *credentials, args);
  auto health = grpc::health::v1::Health::NewStub(channel);
  const absl::Time end = absl::Now() + absl::Seconds(wait_seconds);
  grpc::Status last;
  do {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    grpc::health::v1::HealthCheckResponse r;
    last = health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &r);
    if (last.ok() && r.status() == grpc::health::v1::HealthCheckResponse::SERVING) return channel;
    if (last.ok()) last = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is not serving");
    absl::SleepFor(absl::Milliseconds(200));
  } while (absl::Now() < end);
  return absl::UnavailableError(
      absl::StrCat("cannot reach a serving server at ", server, ": ", last.error_message()));
}

void ConnectionFlags::Authorize(grpc::ClientContext& context) const {
  std::string key = api_key;
  if (key.empty()) {
    if (const char* env = std::getenv("INFINIGEN_API_KEY")) key = env;
  }
  if (!key.empty()) context.AddMetadata("authorization", "Bearer " + key);
}

}  // namespace infinigen::cli
