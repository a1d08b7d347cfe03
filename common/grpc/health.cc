#include "common/grpc/health.h"

#include <grpcpp/ext/health_check_service_server_builder_option.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "grpc/health/v1/health.grpc.pb.h"

namespace infinigen {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// The statuses (HealthCheckServiceInterface, which the server owns and SetHealth reaches) and the
// service that answers them, one object: the server deletes it after its last call.
class HealthService final : public grpc::HealthCheckServiceInterface,
                            public grpc::health::v1::Health::Service {
 public:
  HealthService() { serving_[""] = false; }

  void SetServingStatus(const std::string& name, bool serving) override {
    std::lock_guard lock(mu_);
    if (shut_down_) return;  // the interface's contract: no change after Shutdown
    serving_[name] = serving;
    Changed();
  }

  void SetServingStatus(bool serving) override {
    std::lock_guard lock(mu_);
    if (shut_down_) return;
    for (auto& [name, s] : serving_) s = serving;
    Changed();
  }

  void Shutdown() override {
    std::lock_guard lock(mu_);
    for (auto& [name, s] : serving_) s = false;
    shut_down_ = true;
    Changed();
  }

  grpc::Status Check(grpc::ServerContext*, const HealthCheckRequest* request,
                     HealthCheckResponse* response) override {
    std::lock_guard lock(mu_);
    const auto it = serving_.find(request->service());
    if (it == serving_.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          "no health status for service \"" + request->service() +
                              "\": ask for \"\" (the server) or a service it serves");
    }
    response->set_status(it->second ? HealthCheckResponse::SERVING
                                    : HealthCheckResponse::NOT_SERVING);
    return grpc::Status::OK;
  }

  // The status now, then each change, until the client leaves or the server's shutdown cancels
  // the call (polled every 200 ms: a synchronous handler cannot be woken by it).
  grpc::Status Watch(grpc::ServerContext* context, const HealthCheckRequest* request,
                     grpc::ServerWriter<HealthCheckResponse>* writer) override {
    uint64_t seen = 0;
    bool sent = false;
    HealthCheckResponse::ServingStatus last = HealthCheckResponse::UNKNOWN;
    while (!context->IsCancelled()) {
      HealthCheckResponse::ServingStatus now;
      {
        std::unique_lock lock(mu_);
        if (sent) {
          changed_.wait_for(lock, std::chrono::milliseconds(200), [&] { return version_ != seen; });
        }
        seen = version_;
        const auto it = serving_.find(request->service());
        now = it == serving_.end() ? HealthCheckResponse::SERVICE_UNKNOWN
              : it->second         ? HealthCheckResponse::SERVING
                                   : HealthCheckResponse::NOT_SERVING;
      }
      if (sent && now == last) continue;
      HealthCheckResponse response;
      response.set_status(now);
      if (!writer->Write(response)) break;  // the client is gone
      sent = true;
      last = now;
    }
    return grpc::Status(grpc::StatusCode::CANCELLED, "the watch ended");
  }

 private:
  void Changed() {  // mu_ held
    ++version_;
    changed_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, bool> serving_;  // guarded by mu_
  uint64_t version_ = 0;                 // guarded by mu_: counts changes, for Watch
  bool shut_down_ = false;               // guarded by mu_
};

}  // namespace

void AddHealthService(grpc::ServerBuilder& builder) {
  auto health = std::make_unique<HealthService>();
  builder.RegisterService(static_cast<grpc::health::v1::Health::Service*>(health.get()));
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(
      std::unique_ptr<grpc::HealthCheckServiceInterface>(std::move(health))));
}

void SetHealth(grpc::Server& server, std::initializer_list<const char*> services, bool serving) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;  // no health service on this server
  health->SetServingStatus("", serving);
  for (const char* name : services) health->SetServingStatus(name, serving);
}

}  // namespace infinigen
