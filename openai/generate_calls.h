// The gRPC Generate calls of one HTTP request: one per prompt of a completions batch (one for
// any other request), each read on a thread of its own into one queue, which the HTTP front
// door takes in arrival order. Cancelling cancels them all; the destructor cancels what still
// runs and waits for the threads.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "infinigen/v1/generation.grpc.pb.h"

namespace infinigen::openai {

class GenerateCalls {
 public:
  // What a call's thread read: one of its messages, or its end and status.
  struct Event {
    int call = 0;  // the index of its request
    bool end = false;
    v1::GenerateResponse message;  // when !end
    grpc::Status status;           // when end
  };

  // Starts `requests[i]` as call i on `stub`, each context prepared by `prepare` first (its
  // metadata). `stub` outlives this.
  GenerateCalls(v1::Generation::Stub& stub, std::vector<v1::GenerateRequest> requests,
                const std::function<void(grpc::ClientContext&)>& prepare);
  ~GenerateCalls();
  GenerateCalls(const GenerateCalls&) = delete;
  GenerateCalls& operator=(const GenerateCalls&) = delete;

  // The next event, blocking until there is one; false once every call has ended and every
  // event was taken.
  bool Next(Event& out);
  // Cancels every call (any thread).
  void CancelAll();
  int size() const { return static_cast<int>(calls_.size()); }
  // Call i's context (its trailing metadata once it ended).
  const grpc::ClientContext& context(int call) const { return calls_[call]->context; }

 private:
  struct Call {
    grpc::ClientContext context;
    v1::GenerateRequest request;
    std::thread thread;
  };
  void Read(v1::Generation::Stub& stub, int call);
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || running_ == 0; }

  std::vector<std::unique_ptr<Call>> calls_;
  absl::Mutex mu_;
  std::deque<Event> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace infinigen::openai
