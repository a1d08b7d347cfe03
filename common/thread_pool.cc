#include "common/thread_pool.h"

namespace infinigen {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) threads_.emplace_back([this] { Worker(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& t : threads_) t.join();
}

void ThreadPool::Drain() {
  for (;;) {
    const std::function<void(int64_t)>* job;
    int64_t i;
    {
      absl::MutexLock lock(&mu_);
      if (job_ == nullptr || next_ >= total_) return;
      job = job_;
      i = next_++;
    }
    (*job)(i);
    absl::MutexLock lock(&mu_);
    ++done_;
  }
}

void ThreadPool::Worker() {
  uint64_t seen = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (generation_ != seen && job_ != nullptr && next_ < total_);
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      seen = generation_;
    }
    Drain();
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (threads_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  absl::MutexLock submit(&submit_mu_);
  {
    absl::MutexLock lock(&mu_);
    job_ = &fn;
    next_ = 0;
    total_ = n;
    done_ = 0;
    ++generation_;
  }
  Drain();
  absl::MutexLock lock(&mu_);
  auto finished = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ == total_; };
  mu_.Await(absl::Condition(&finished));
  job_ = nullptr;
}

}  // namespace infinigen
