#include "openai/generate_calls.h"

#include <utility>

namespace infinigen::openai {

GenerateCalls::GenerateCalls(v1::Generation::Stub& stub, std::vector<v1::GenerateRequest> requests,
                             const std::function<void(grpc::ClientContext&)>& prepare) {
  calls_.reserve(requests.size());
  for (v1::GenerateRequest& r : requests) {
    auto call = std::make_unique<Call>();
    prepare(call->context);
    call->request = std::move(r);
    calls_.push_back(std::move(call));
  }
  {
    absl::MutexLock lock(&mu_);
    running_ = size();
  }
  for (int i = 0; i < size(); ++i) {
    calls_[i]->thread = std::thread([this, &stub, i] { Read(stub, i); });
  }
}

GenerateCalls::~GenerateCalls() {
  CancelAll();
  for (auto& call : calls_) call->thread.join();
}

void GenerateCalls::Read(v1::Generation::Stub& stub, int i) {
  Call& call = *calls_[i];
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub.Generate(&call.context, call.request);
  Event event;
  event.call = i;
  while (reader->Read(&event.message)) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(event));
    event = Event();
    event.call = i;
  }
  event.end = true;
  event.status = reader->Finish();
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(event));
  --running_;
}

bool GenerateCalls::Next(Event& out) {
  absl::MutexLock lock(&mu_, absl::Condition(this, &GenerateCalls::Ready));
  if (queue_.empty()) return false;
  out = std::move(queue_.front());
  queue_.pop_front();
  return true;
}

void GenerateCalls::CancelAll() {
  for (auto& call : calls_) call->context.TryCancel();
}

}  // namespace infinigen::openai
