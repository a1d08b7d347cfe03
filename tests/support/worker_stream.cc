#include "tests/support/worker_stream.h"

#include <chrono>

#include "tests/support/token_request.h"

namespace infinigen::testing {

worker::v1::GenerateRequest TokenRequest(const std::vector<int32_t>& prompt, int max_new,
                                         float temperature, uint64_t seed,
                                         const std::string& policy) {
  worker::v1::GenerateRequest r;
  FillTokenRequest(r, prompt, max_new, temperature, seed);
  if (!policy.empty()) r.mutable_selection()->set_policy(policy);
  return r;
}

WorkerStreamResult StreamWorker(worker::v1::Worker::Stub& stub,
                                const worker::v1::GenerateRequest& request,
                                grpc::ClientContext* context,
                                const std::function<void(int)>& on_token) {
  grpc::ClientContext own;
  if (context == nullptr) {
    context = &own;
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  }
  WorkerStreamResult r;
  auto reader = stub.Generate(context, request);
  worker::v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    for (int32_t t : msg.token_ids()) r.tokens.push_back(t);
    r.text += msg.text();
    if (on_token && msg.token_ids_size() > 0) on_token(static_cast<int>(r.tokens.size()));
    r.last = msg;
  }
  r.status = reader->Finish();
  return r;
}

}  // namespace infinigen::testing
