#include "router/router_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "common/grpc/health.h"
#include "common/grpc/listen.h"
#include "common/grpc/tls.h"
#include "common/status_macros.h"
#include "infinigen/v1/generation.grpc.pb.h"

namespace infinigen {

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Start(RouterServerConfig config) {
  IG_RETURN_IF_ERROR(config.options.Validate());
  IG_ASSIGN_OR_RETURN(auto credentials, MakeServerCredentials(config.tls));
  std::unique_ptr<RouterServer> r(new RouterServer());
  if (!config.api_keys_file.empty()) {
    IG_ASSIGN_OR_RETURN(ApiKeys keys, ApiKeys::Load(config.api_keys_file));
    r->api_keys_.emplace(std::move(keys));
    config.options.api_keys = &*r->api_keys_;
  }
  IG_ASSIGN_OR_RETURN(r->pool_, WorkerPool::Create(config.pool));
  r->service_ = std::make_unique<RouterService>(*r->pool_, config.options);
  if (config.metrics_port > 0) {
    IG_ASSIGN_OR_RETURN(r->metrics_, RouterMetrics::Start(config.metrics_port,
                                                          r->service_->admission(), *r->pool_));
    r->service_->SetMetrics(r->metrics_.get());
  }

  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  AddHealthService(builder);
  Listen(builder, config.listen, credentials, &r->port_);
  // Requests up to 4x the limit reach the service, which names the limit (INVALID_ARGUMENT);
  // larger ones are cut off by gRPC itself (RESOURCE_EXHAUSTED).
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::min<int64_t>(4 * config.options.limits.max_request_bytes, 1 << 30)));
  builder.RegisterService(r->service_.get());
  r->unknown_methods_ = std::make_unique<grpc::CallbackGenericService>();
  builder.RegisterCallbackGenericService(r->unknown_methods_.get());
  r->server_ = builder.BuildAndStart();
  if (r->server_ == nullptr || r->port_ == 0) {
    return absl::UnavailableError(CannotListen(config.listen));
  }
  SetHealth(*r->server_, {v1::Generation::service_full_name()}, true);
  if (!config.http_listen.empty()) {
    // In-process: the same service, keys and limits, without TLS or a port in between. The
    // HTTP port serves TLS with the gRPC port's certificate (and client CA).
    config.http.listen = config.http_listen;
    config.http.max_body_bytes = static_cast<size_t>(4 * config.options.limits.max_request_bytes);
    config.http.tls = config.tls;
    IG_ASSIGN_OR_RETURN(r->http_,
                        openai::HttpFrontDoor::Start(
                            config.http, r->server_->InProcessChannel(grpc::ChannelArguments())));
  }
  return r;
}

RouterServer::~RouterServer() {
  if (server_ != nullptr) Shutdown(absl::Seconds(1));
}

void RouterServer::Drain(absl::Duration timeout) {
  SetHealth(*server_, {v1::Generation::service_full_name()}, false);
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end &&
         service_->admission().streams() + service_->admission().queued() > 0) {
    absl::SleepFor(absl::Milliseconds(50));
  }
}

void RouterServer::Shutdown(absl::Duration grace) {
  if (server_ == nullptr) return;
  if (http_ != nullptr) http_->Shutdown();  // its calls are the server's: end them first
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  server_.reset();
}

}  // namespace infinigen
