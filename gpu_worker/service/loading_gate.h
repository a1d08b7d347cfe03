// LoadingGate: the Worker service as the gRPC server sees it from the moment its port opens,
// before the model is loaded. Until Open() every call is UNAVAILABLE with a message saying the
// model is loading (health reports NOT_SERVING meanwhile, so probes and the router wait); after
// it, every call goes to the WorkerService.
#pragma once

#include <atomic>

#include "gpu_worker/service/worker_service.h"

namespace infinigen {

class LoadingGate final : public worker::v1::Worker::Service {
 public:
  // `service` must outlive every call the server may still make.
  void Open(WorkerService* service) { service_.store(service, std::memory_order_release); }

  grpc::Status Generate(grpc::ServerContext* context, const worker::v1::GenerateRequest* request,
                        grpc::ServerWriter<worker::v1::GenerateResponse>* writer) override {
    WorkerService* s = service_.load(std::memory_order_acquire);
    return s != nullptr ? s->Generate(context, request, writer) : Loading();
  }
  grpc::Status Info(grpc::ServerContext* context, const worker::v1::InfoRequest* request,
                    worker::v1::InfoResponse* response) override {
    WorkerService* s = service_.load(std::memory_order_acquire);
    return s != nullptr ? s->Info(context, request, response) : Loading();
  }
  grpc::Status Tokenize(grpc::ServerContext* context, const infinigen::v1::TokenizeRequest* request,
                        infinigen::v1::TokenizeResponse* response) override {
    WorkerService* s = service_.load(std::memory_order_acquire);
    return s != nullptr ? s->Tokenize(context, request, response) : Loading();
  }

 private:
  static grpc::Status Loading() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the worker is still loading its model; retry once its gRPC health check "
                        "reports SERVING");
  }

  std::atomic<WorkerService*> service_{nullptr};
};

}  // namespace infinigen
