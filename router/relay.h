// Relay: the failover rules of one relayed stream, as a state machine without gRPC or clocks.
// It decides which worker call comes next and what it carries (the tokens already sent to the
// client, the stream's home in the KV store so that the next worker takes the KV over instead of
// recomputing it), what each worker message becomes for the client, when a stream under way
// waits for a worker with room, and when the request fails and how. RunRelay
// (router/relay_driver.h) drives it over the workers; tests drive it through timeline tables
// (tests/unit/relay_test.cc).
//
// The rules:
//   - A call that fails the way a dead, frozen or full worker fails (UNAVAILABLE,
//     RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNKNOWN, or cancelled by the stall watchdog) is
//     retried on another worker; anything else (bad input, the deadline) is the request's own
//     and goes to the client as it is.
//   - A worker that failed leaves placement (the pool's health checks bring it back) and is not
//     tried again by this request; after `max_attempts` failed calls the request fails. A full
//     worker is only skipped.
//   - Once tokens were sent, the next worker gets them as resume tokens (same seed, so the same
//     continuation) and, with `resume_from_store`, the stream's store sequence to attach to; a
//     request of several samples (sampling.n > 1) resumes each sample from its own tokens and
//     store sequence (resumed_samples), and those that had ended do not run again.
//   - When every worker failed or is full: a request that sent nothing fails at once
//     (RESOURCE_EXHAUSTED with a pushback when they were full, so the client backs off); a
//     stream under way polls for a worker until `resume_wait` after its first failover or the
//     client's deadline, and after each poll the workers that failed or were full may be tried
//     again, once placement offers them (a restarted worker, a link to the store restored). A
//     failover is a stream under way leaving its worker (a full worker that refuses to take it
//     over is not one).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "infinigen/v1/generation.pb.h"
#include "infinigen/worker/v1/worker.pb.h"

namespace infinigen {

struct RelayRules {
  int max_attempts = 4;  // worker calls that may fail (full workers do not count)
  absl::Duration resume_wait = absl::Seconds(10);
  bool resume_from_store = true;
  absl::Duration poll = absl::Milliseconds(100);  // between picks while no worker is available
};

// What the driver does next.
struct RelayAction {
  enum class Kind {
    kPick,    // ask placement for an available worker not in Relay::excluded(), then Picked()
    kCall,    // call `worker` with Relay::request(): Received() per message, then Ended()
    kWait,    // sleep `wait`, then Waited()
    kFinish,  // end the client's call with `status`
  };
  Kind kind = Kind::kPick;
  std::string worker;             // kCall
  int64_t resume_tokens = 0;      // kCall: tokens already sent, which the worker continues
  uint64_t resume_store = 0;      // kCall: the store sequence it attaches to (0: recompute)
  absl::Duration wait;            // kWait
  absl::Status status;            // kFinish
  int64_t retry_pushback_ms = 0;  // kFinish: > 0, tell the client when to retry
  // After a failed call (kPick, or kFinish when it was the last attempt):
  std::string failed;     // the worker that failed: take it out of placement
  bool failover = false;  // the stream was under way: the next worker continues it
  bool stalled = false;   // the call ended because the worker stopped sending

  // "pick", "pick (w1 failed, stalled, failover)", "call w2 (resume 3 tokens, store 7)",
  // "wait 100ms", "finish UNAVAILABLE: ... (w1 failed)": for logs and timeline tables.
  std::string DebugString() const;
};

// A worker message as the client gets it.
struct RelayForward {
  v1::GenerateResponse message;
  bool first_tokens = false;  // the stream's first tokens (time to first token)
  bool resumed = false;       // this call's worker attached to the stored KV (a resume)

  std::string DebugString() const;  // "forward 2 tokens (first)", "forward 1 token, final ..."
};

class Relay {
 public:
  // `request`: what every worker gets (request id and seed set); `budget`: max new tokens.
  Relay(const RelayRules& rules, worker::v1::GenerateRequest request, int64_t budget,
        absl::Time client_deadline);

  RelayAction Start();
  RelayAction Picked(absl::string_view worker, absl::Time now);  // "" when none was available
  RelayAction Waited();
  RelayForward Received(worker::v1::GenerateResponse message);
  // The current call ended with `status`; `stalled`: the stall watchdog cancelled it.
  RelayAction Ended(const absl::Status& status, bool stalled, absl::Time now);
  RelayAction ClientGone();  // the client cancelled or stopped reading

  // For kCall: the request with the resume fields of this attempt.
  const worker::v1::GenerateRequest& request() const { return request_; }
  // For kPick: the workers this request must not be placed on.
  std::vector<std::string> excluded() const;
  // For kCall: tokens the worker is expected to generate (placement's load).
  int64_t expected_tokens() const;

  const std::vector<int32_t>& sent() const { return sent_; }
  int failovers() const { return failovers_; }
  int resumes() const { return resumes_; }

 private:
  RelayAction Fail() const;

  const RelayRules rules_;
  worker::v1::GenerateRequest request_;
  const int64_t budget_;
  const absl::Time client_deadline_;
  std::vector<int32_t> sent_;  // every token sent (of all samples)
  // sampling.n > 1: what each sample sent, where its KV is, whether it ended.
  struct Sample {
    std::vector<int32_t> sent;
    uint64_t home = 0;
    bool finished = false;
  };
  std::vector<Sample> samples_;
  bool forwarded_ = false;     // a message went to the client (it carries the request id)
  bool first_message_ = true;  // of the current call
  std::string current_;        // the worker of the current call
  uint64_t home_ = 0;          // the stream's store sequence, as its last worker said
  int failovers_ = 0;
  int resumes_ = 0;
  int calls_ = 0;         // worker calls made
  int failed_calls_ = 0;  // of them, failed as a dead worker fails (not full)
  std::vector<std::string> failed_, full_;
  absl::Status last_ = absl::UnavailableError("no worker is available");
  absl::Time resume_deadline_ = absl::InfiniteFuture();
};

// Whether a worker call's failure is one that another worker may not have.
bool RetriableOnAnotherWorker(absl::StatusCode code);

}  // namespace infinigen
