#include "kv_store/arena_prefaulter.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack it
#endif

namespace infinigen {
namespace {

// Bytes committed per madvise: a huge page, so that a stop waits for little.
constexpr size_t kPiece = size_t{2} << 20;
// Retries of a piece the kernel interrupted (EINTR: a signal; EAGAIN: pages busy) before the
// thread gives up on prefaulting.
constexpr int kRetries = 100;

}  // namespace

ArenaPrefaulter::ArenaPrefaulter(uint8_t* base, size_t bytes, size_t ahead_bytes,
                                 bool idle_priority)
    : base_(base),
      bytes_(bytes),
      ahead_bytes_(ahead_bytes),
      page_bytes_(static_cast<size_t>(::sysconf(_SC_PAGESIZE))) {
  wanted_.store(PageEnd(ahead_bytes_), std::memory_order_relaxed);
  thread_ = std::thread([this] { Run(); });
  if (idle_priority) {  // set here, not in Run: the destructor's raise then always comes after
    sched_param idle{};
    ::pthread_setschedparam(thread_.native_handle(), SCHED_IDLE, &idle);
  }
}

ArenaPrefaulter::~ArenaPrefaulter() {
  stop_.store(true);
  signal_.fetch_add(1);
  signal_.notify_one();
  sched_param normal{};
  ::pthread_setschedparam(thread_.native_handle(), SCHED_OTHER, &normal);  // EPERM: as it is
  thread_.join();
}

size_t ArenaPrefaulter::PageEnd(size_t bytes) const {
  const size_t capped = std::min(bytes, bytes_);
  return (capped + page_bytes_ - 1) / page_bytes_ * page_bytes_;
}

void ArenaPrefaulter::Reached(size_t high_water_bytes) {
  const size_t wanted = PageEnd(high_water_bytes + std::min(ahead_bytes_, bytes_));
  size_t seen = wanted_.load(std::memory_order_relaxed);
  while (seen < wanted && !wanted_.compare_exchange_weak(seen, wanted)) {
  }
  if (seen >= wanted) return;  // nothing new asked for
  signal_.fetch_add(1);
  signal_.notify_one();
}

size_t ArenaPrefaulter::committed_bytes() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

bool ArenaPrefaulter::working() const {
  absl::MutexLock lock(&mu_);
  return working_;
}

bool ArenaPrefaulter::WaitCommitted(size_t bytes, absl::Time deadline) const {
  const size_t want = std::min(bytes, bytes_);
  absl::MutexLock lock(&mu_);
  auto done = [this, want]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return committed_ >= want || !working_; };
  mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  return committed_ >= want;
}

void ArenaPrefaulter::Run() {
  size_t committed = 0;  // the thread's own copy of committed_
  for (;;) {
    const uint32_t seen = signal_.load();
    if (stop_.load()) return;
    const size_t wanted = wanted_.load();
    if (committed >= wanted) {
      signal_.wait(seen);  // until Reached or the destructor changes it
      continue;
    }
    const size_t to = std::min(wanted, committed + kPiece);
    int rc = 0;
    for (int attempt = 0; attempt < kRetries; ++attempt) {
      rc = ::madvise(base_ + committed, to - committed, MADV_POPULATE_WRITE);
      if (rc == 0 || (errno != EINTR && errno != EAGAIN) || stop_.load()) break;
    }
    absl::MutexLock lock(&mu_);
    if (rc != 0) {  // EINVAL before Linux 5.14; ENOMEM when the host has no memory for them
      working_ = false;
      return;
    }
    committed = committed_ = to;
  }
}

}  // namespace infinigen
