// The router's stall rules (router/stall_watchdog.h) as a table, and the watchdog cancelling the
// call of a stream whose worker the pool's health checks find down, but not one whose worker is
// serving, nor one whose worker only had another call fail.
#include "router/stall_watchdog.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>

namespace infinigen {
namespace {

TEST(StallRules, Table) {
  StallRules r;
  r.when_down = absl::Seconds(1);
  r.timeout = absl::Seconds(30);
  r.gap_factor = 20;
  struct Case {
    double idle_s;
    bool down;
    int64_t messages;
    double active_s;
    bool stalled;
  } cases[] = {
      {0.5, true, 0, 0, false},    // down, but not idle long enough
      {1.0, true, 0, 0, true},     // down and idle: frozen before the first token
      {1.5, true, 40, 4, true},    // down and idle mid-stream
      {600, false, 0, 0, false},   // a long prefill on a live worker is never a stall
      {29, false, 10, 1, false},   // serving: under the floor
      {30, false, 10, 1, true},    // serving, silent past the floor (mean gap 0.11 s)
      {30, false, 11, 20, false},  // mean gap 2 s: 20 x 2 s = 40 s allowed
      {40, false, 11, 20, true},   //   and reached
      {30, false, 1, 0, true},     // one message only: the floor alone
  };
  for (const Case& c : cases) {
    EXPECT_EQ(IsStalled(r, absl::Seconds(c.idle_s), c.down, c.messages, absl::Seconds(c.active_s)),
              c.stalled)
        << "idle " << c.idle_s << " s, down " << c.down << ", " << c.messages << " messages over "
        << c.active_s << " s";
  }
  EXPECT_TRUE(r.Validate().ok());
  r.gap_factor = 0.5;
  EXPECT_FALSE(r.Validate().ok());
  r.gap_factor = 20;
  r.when_down = absl::ZeroDuration();
  EXPECT_FALSE(r.Validate().ok());
}

// A pooled worker in `state` (nothing listens at the address: no call is made).
std::unique_ptr<PooledWorker> WorkerIn(PooledWorker::State state, int port) {
  const std::string address = "127.0.0.1:" + std::to_string(port);
  auto w = std::make_unique<PooledWorker>(
      address, grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  w->set_state(state);
  return w;
}

// Waits up to 5 s for the watchdog to find `watch` stalled.
bool StalledSoon(const StallWatchdog::Watch& watch) {
  for (int i = 0; i < 500 && !watch.stalled(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return watch.stalled();
}

TEST(StallWatchdog, CancelsTheCallOfAStreamWhoseWorkerIsDown) {
  StallRules r;
  r.when_down = absl::Milliseconds(50);
  StallWatchdog dog(r, absl::Milliseconds(10));
  auto serving = WorkerIn(PooledWorker::State::kServing, 1);
  auto down = WorkerIn(PooledWorker::State::kDown, 2);
  grpc::ClientContext a, b;
  StallWatchdog::Watch live(dog, a, *serving);
  StallWatchdog::Watch frozen(dog, b, *down);
  EXPECT_TRUE(StalledSoon(frozen));
  EXPECT_FALSE(live.stalled());
}

// One call's failure (one sequence's KV error on a loaded machine) took the worker out of
// placement and, when that counted as down, moved every other stream on it that had been silent
// for a second: all of its long prefills (the router_smollm2_test flake, 2026-12-07).
TEST(StallWatchdog, AnotherCallsFailureDoesNotMoveAStreamOffAWorkerThatAnswersHealth) {
  StallRules r;
  r.when_down = absl::Milliseconds(20);
  StallWatchdog dog(r, absl::Milliseconds(5));
  auto worker = WorkerIn(PooledWorker::State::kServing, 1);
  PooledWorker& failed = *worker;
  failed.MarkFailed();
  EXPECT_EQ(failed.state(), PooledWorker::State::kFailed);
  EXPECT_FALSE(failed.available()) << "out of placement until a health check finds it serving";
  grpc::ClientContext c;
  StallWatchdog::Watch prefill(dog, c, failed);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // 10 x when_down, 40 ticks
  EXPECT_FALSE(prefill.stalled());
  // A health check that gets no answer makes it down, and the failure of a call then keeps it so.
  failed.set_state(PooledWorker::State::kDown);
  failed.MarkFailed();
  EXPECT_EQ(failed.state(), PooledWorker::State::kDown);
  EXPECT_TRUE(StalledSoon(prefill));
}

}  // namespace
}  // namespace infinigen
