#include "kv_store/arena_prefaulter.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack it
#endif

namespace infinigen {
namespace {

// Bytes committed per madvise: a huge page, so that a stop waits for little.
constexpr size_t kPiece = size_t{2} << 20;

}  // namespace

ArenaPrefaulter::ArenaPrefaulter(uint8_t* base, size_t bytes, size_t ahead_bytes)
    : base_(base), bytes_(bytes), ahead_bytes_(ahead_bytes) {
  {
    absl::MutexLock lock(&mu_);
    wanted_ = std::min(bytes_, ahead_bytes_);
  }
  thread_ = std::thread([this] { Run(); });
}

ArenaPrefaulter::~ArenaPrefaulter() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  // Back to a normal thread for the piece in progress: on busy cores an idle thread's few
  // milliseconds of work could take seconds, and this waits for them.
  sched_param normal{};
  ::pthread_setschedparam(thread_.native_handle(), SCHED_OTHER, &normal);
  thread_.join();
}

void ArenaPrefaulter::Reached(size_t high_water_bytes) {
  const size_t wanted = std::min(bytes_, high_water_bytes + std::min(ahead_bytes_, bytes_));
  absl::MutexLock lock(&mu_);
  wanted_ = std::max(wanted_, wanted);
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
  // Only on time the cores would otherwise idle: the work is the page faults the appends would
  // take, and a worker's compute threads must not wait for it.
  sched_param idle{};
  ::pthread_setschedparam(::pthread_self(), SCHED_IDLE, &idle);
  for (;;) {
    size_t from = 0, to = 0;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || committed_ < wanted_; };
      mu_.Await(absl::Condition(&work));
      if (stop_) return;
      from = committed_;
      to = std::min(wanted_, from + kPiece);
    }
    // Outside the lock: a piece takes milliseconds where pages are slow to fault.
    int rc = 0;
    do {
      rc = ::madvise(base_ + from, to - from, MADV_POPULATE_WRITE);
    } while (rc != 0 && (errno == EINTR || errno == EAGAIN));
    absl::MutexLock lock(&mu_);
    if (rc != 0) {  // EINVAL before Linux 5.14; ENOMEM when the host has no memory for them
      working_ = false;
      return;
    }
    committed_ = to;
  }
}

}  // namespace infinigen
