// The gRPC Generate calls of one HTTP request: one per prompt of a completions batch (one for
// any other request), read by gRPC's callback API (no thread of their own) into one queue, which
// the HTTP front door takes in arrival order. The queue is bounded: past `max_queued_bytes` of
// messages not yet taken (a streamed answer whose client stopped reading), every call is
// cancelled and overflowed() says why. Cancelling cancels them all; the destructor cancels what
// still runs and waits until every call has ended.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "infinigen/v1/generation.grpc.pb.h"

namespace infinigen::openai {

class GenerateCalls {
 public:
  // What a call delivered: one of its messages, or its end and status.
  struct Event {
    int call = 0;  // the index of its request
    bool end = false;
    v1::GenerateResponse message;  // when !end
    grpc::Status status;           // when end
    size_t bytes = 0;              // the message's serialized size
  };

  static constexpr size_t kMaxQueuedBytes = size_t{64} << 20;

  // Starts `requests[i]` as call i on `stub`, each context prepared by `prepare` first (its
  // metadata).
  GenerateCalls(v1::Generation::Stub& stub, std::vector<v1::GenerateRequest> requests,
                const std::function<void(grpc::ClientContext&)>& prepare,
                size_t max_queued_bytes = kMaxQueuedBytes);
  ~GenerateCalls();
  GenerateCalls(const GenerateCalls&) = delete;
  GenerateCalls& operator=(const GenerateCalls&) = delete;

  // The next event, blocking until there is one; false once every call has ended and every
  // event was taken.
  bool Next(Event& out);
  // Cancels every call (any thread).
  void CancelAll();
  // The calls were cancelled because the queue outgrew max_queued_bytes.
  bool overflowed() const {
    absl::MutexLock lock(&state_->mu);
    return state_->overflowed;
  }
  int size() const { return static_cast<int>(state_->calls.size()); }
  // Call i's context (its trailing metadata once it ended).
  const grpc::ClientContext& context(int call) const { return state_->calls[call]->context; }

 private:
  class Reader;
  struct Call {
    grpc::ClientContext context;
    v1::GenerateRequest request;
  };
  // Shared with the calls' readers, which outlive this object until their last callback.
  struct State {
    std::vector<std::unique_ptr<Call>> calls;
    mutable absl::Mutex mu;
    size_t max_queued_bytes = 0;
    std::deque<Event> queue ABSL_GUARDED_BY(mu);
    size_t queued_bytes ABSL_GUARDED_BY(mu) = 0;
    bool overflowed ABSL_GUARDED_BY(mu) = false;
    int running ABSL_GUARDED_BY(mu) = 0;

    void CancelAll() {
      for (auto& call : calls) call->context.TryCancel();
    }
  };
  std::shared_ptr<State> state_;
};

}  // namespace infinigen::openai
