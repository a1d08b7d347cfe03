// The router's workers: a static list of addresses, DNS names whose every address is a worker
// (a Kubernetes headless service), and channels handed in directly (the all-in-one server).
// A background thread re-resolves the names and checks every worker's gRPC health: SERVING means
// available, NOT_SERVING draining (no new requests), no answer unavailable. Placement picks the
// available worker with the fewest outstanding tokens, or, for a session id, the same worker
// for as long as it stays available (rendezvous hashing, so router replicas agree). A worker
// that turns SERVING is asked for its Info once, so that the router can describe the model
// without calling a worker that may be frozen.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/tls_files.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"

namespace infinigen {

class PooledWorker {
 public:
  PooledWorker(std::string address, std::shared_ptr<grpc::Channel> channel);

  const std::string& address() const { return address_; }
  worker::v1::Worker::Stub& stub() { return *stub_; }
  grpc::health::v1::Health::Stub& health() { return *health_; }

  // Tokens this router expects the worker still to generate for it (placement's load).
  int64_t outstanding() const { return outstanding_.load(std::memory_order_relaxed); }
  void AddOutstanding(int64_t n) { outstanding_.fetch_add(n, std::memory_order_relaxed); }

  // kDown: its health check got no answer (a dead, frozen or unreachable process). kFailed: a
  // call to it failed (WorkerPool::ReportFailure) while its health checks still answer: out of
  // placement until the next check finds it serving, but not down for the stall watchdog, whose
  // other streams on it are not moved for one call's failure (one sequence's KV error said
  // nothing of the other sequences there).
  enum class State { kUnknown, kServing, kDraining, kDown, kFailed };
  State state() const { return state_.load(std::memory_order_relaxed); }
  void set_state(State s) { state_.store(s, std::memory_order_relaxed); }
  // kFailed, unless a health check has found it down (that verdict stands).
  void MarkFailed() {
    State s = state();
    while (s != State::kDown &&
           !state_.compare_exchange_weak(s, State::kFailed, std::memory_order_relaxed)) {
    }
  }
  bool available() const { return state() == State::kServing; }

  // Health checks in a row that got no answer in time (DEADLINE_EXCEEDED), counted by the pool:
  // a worker busy on every core may answer one late and still be serving.
  int CountMissedCheck() { return missed_checks_.fetch_add(1, std::memory_order_relaxed) + 1; }
  void CheckAnswered() { missed_checks_.store(0, std::memory_order_relaxed); }

  // What the worker said of itself (model, limits) when it last turned SERVING; null before.
  std::shared_ptr<const worker::v1::InfoResponse> info() const {
    absl::MutexLock l(&info_mu_);
    return info_;
  }
  void set_info(std::shared_ptr<const worker::v1::InfoResponse> info) {
    absl::MutexLock l(&info_mu_);
    info_ = std::move(info);
  }

 private:
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<worker::v1::Worker::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  std::atomic<int64_t> outstanding_{0};
  std::atomic<State> state_{State::kUnknown};
  std::atomic<int> missed_checks_{0};
  mutable absl::Mutex info_mu_;
  std::shared_ptr<const worker::v1::InfoResponse> info_ ABSL_GUARDED_BY(info_mu_);
};

struct WorkerPoolConfig {
  // "host:port" is one worker; "dns:///name:port" makes every address of `name` a worker.
  std::vector<std::string> targets;
  // Workers given as channels (the all-in-one server's in-process worker), by name.
  std::vector<std::pair<std::string, std::shared_ptr<grpc::Channel>>> channels;
  TlsFiles tls;  // TLS to the workers when tls.ca is set; tls.cert/key make it mTLS
  absl::Duration health_interval = absl::Seconds(1);
  absl::Duration health_timeout = absl::Milliseconds(800);
  // Checks in a row that time out before a worker counts as down (its streams then move, and it
  // gets no requests until a check finds it serving). A check refused or broken (no process, a
  // reset connection) counts at once. 0: never by timeouts (the all-in-one server's in-process
  // worker, which lives as long as the router: there, a late answer only means busy cores).
  int health_misses = 3;

  absl::Status Validate() const;
};

class WorkerPool {
 public:
  // Resolves and probes every worker once before returning, then keeps doing so in the
  // background. Fails only on a malformed config (workers may all be down at first).
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Create(WorkerPoolConfig config);
  ~WorkerPool();

  // An available worker not in `exclude`, or null. See the file comment for the rule.
  std::shared_ptr<PooledWorker> Pick(absl::string_view session_id,
                                     const std::vector<const PooledWorker*>& exclude) const;
  // A call to `w` failed the way a dead worker fails: take it out of placement until a health
  // check finds it serving again (State::kFailed; a check that gets no answer makes it kDown).
  void ReportFailure(PooledWorker& w);

  std::vector<std::shared_ptr<PooledWorker>> Workers() const;
  int available() const;

 private:
  explicit WorkerPool(WorkerPoolConfig config);
  void Refresh();  // re-resolve names, then probe health
  void Loop();

  const WorkerPoolConfig config_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<PooledWorker>> workers_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread thread_;
};

// Every address `name` resolves to, as "ip:port" ("[ip6]:port"); NOT_FOUND when none.
absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& host,
                                                    const std::string& port);

}  // namespace infinigen
