// A fixed set of worker threads for data-parallel loops (the KV store's large gathers). The
// pool owns and joins its threads; ParallelFor blocks until every index has run.
#pragma once

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace infinigen {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()) + 1; }
  // Runs fn(i) for i in [0, n) on the pool and the calling thread; returns when all are done.
  // Calls from several threads at once are serialized.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void Worker();
  // Claims and runs indices of the current job until none are left.
  void Drain() ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<std::thread> threads_;
  absl::Mutex submit_mu_;  // one ParallelFor at a time
  absl::Mutex mu_;
  const std::function<void(int64_t)>* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t total_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace infinigen
