#include "openai/generate_calls.h"

#include <utility>

namespace infinigen::openai {

// Reads one call's stream on gRPC's callback threads; deletes itself when the call ends.
class GenerateCalls::Reader final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  Reader(std::shared_ptr<State> state, int call) : state_(std::move(state)), call_(call) {}

  void Start(v1::Generation::Stub& stub) {
    Call& call = *state_->calls[call_];
    stub.async()->Generate(&call.context, &call.request, this);
    StartRead(&message_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended: OnDone follows
    Event event;
    event.call = call_;
    event.bytes = message_.ByteSizeLong();
    event.message = std::move(message_);
    bool overflow = false;
    {
      absl::MutexLock lock(&state_->mu);
      state_->queued_bytes += event.bytes;
      state_->queue.push_back(std::move(event));
      if (state_->queued_bytes > state_->max_queued_bytes && !state_->overflowed) {
        state_->overflowed = overflow = true;
      }
    }
    // Not under the lock: a cancel may run a call's OnDone on this thread.
    if (overflow) state_->CancelAll();
    message_.Clear();
    StartRead(&message_);
  }

  void OnDone(const grpc::Status& status) override {
    Event event;
    event.call = call_;
    event.end = true;
    event.status = status;
    {
      absl::MutexLock lock(&state_->mu);
      state_->queue.push_back(std::move(event));
      --state_->running;
    }
    delete this;  // the last touch of the call; the state lives on while anyone holds it
  }

 private:
  std::shared_ptr<State> state_;
  const int call_;
  v1::GenerateResponse message_;
};

GenerateCalls::GenerateCalls(v1::Generation::Stub& stub, std::vector<v1::GenerateRequest> requests,
                             const std::function<void(grpc::ClientContext&)>& prepare,
                             size_t max_queued_bytes)
    : state_(std::make_shared<State>()) {
  state_->max_queued_bytes = max_queued_bytes;
  state_->calls.reserve(requests.size());
  for (v1::GenerateRequest& r : requests) {
    auto call = std::make_unique<Call>();
    prepare(call->context);
    call->request = std::move(r);
    state_->calls.push_back(std::move(call));
  }
  {
    absl::MutexLock lock(&state_->mu);
    state_->running = size();
  }
  for (int i = 0; i < size(); ++i) (new Reader(state_, i))->Start(stub);
}

GenerateCalls::~GenerateCalls() {
  CancelAll();
  State& s = *state_;
  absl::MutexLock lock(
      &s.mu,
      absl::Condition(
          +[](State* st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) { return st->running == 0; }, &s));
}

bool GenerateCalls::Next(Event& out) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu, absl::Condition(
                                  +[](State* st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) {
                                    return !st->queue.empty() || st->running == 0;
                                  },
                                  &s));
  if (s.queue.empty()) return false;
  out = std::move(s.queue.front());
  s.queue.pop_front();
  s.queued_bytes -= out.bytes;
  return true;
}

void GenerateCalls::CancelAll() { state_->CancelAll(); }

}  // namespace infinigen::openai
