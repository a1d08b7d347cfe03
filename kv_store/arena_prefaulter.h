// Commits the arena's pages ahead of the blocks the store hands out, on a thread of its own, so
// that appends seldom wait for the kernel to fault their blocks in.
//
// Why: the arena is mapped without committing memory (a store's capacity is not its use), so the
// first write to each page faults. With transparent huge pages each fault zeroes (and may first
// compact) 2 MiB; in a VM each also faults the host. Measured on the project's 2-core VM: ~5 ms
// a huge page. A decode step whose tokens start new blocks in every layer (after a 4096-token
// prompt on SmolLM2: 180 blocks of 64 KiB) waited ~30 ms for them, on top of its 12-16
// (docs/benchmarks.md). Blocks freed by closed sequences are reused first (the arena's free list
// is LIFO), so fresh pages are needed only past the highest block ever handed out, and the arena
// hands those out in address order: this commits [0, high water + ahead).
//
// How: madvise(MADV_POPULATE_WRITE) (Linux 5.14), which commits pages without writing to them, so
// it may run while the store writes rows into the same pages. The thread runs at idle priority
// (SCHED_IDLE: on a busy machine it gets a sliver of time, and the time the page faults cost is
// taken when the cores would otherwise idle). If the kernel refuses the call (older than 5.14,
// or out of memory), prefaulting stops and pages fault as before.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace infinigen {

class ArenaPrefaulter {
 public:
  // Commits [0, ahead_bytes) at once, then keeps `ahead_bytes` committed past every high water
  // mark reported, up to `bytes`. `base` (page-aligned) must stay mapped, `bytes` of it, until
  // this is destroyed. `idle_priority` false: a normal thread (tests on busy machines).
  ArenaPrefaulter(uint8_t* base, size_t bytes, size_t ahead_bytes, bool idle_priority = true);
  // Stops the thread: a piece in progress (at most 2 MiB) finishes first. At idle priority on
  // busy cores that may take a while: the thread is raised to normal priority first where the
  // process may do that (CAP_SYS_NICE or RLIMIT_NICE; otherwise it finishes at idle priority).
  ~ArenaPrefaulter();
  ArenaPrefaulter(const ArenaPrefaulter&) = delete;
  ArenaPrefaulter& operator=(const ArenaPrefaulter&) = delete;

  // The arena's blocks now reach `high_water_bytes` from its base. Lock-free: Arena::Allocate
  // calls it under the store's lock, which must never wait for this (idle-priority) thread.
  void Reached(size_t high_water_bytes);

  // Bytes from the base known to be committed.
  size_t committed_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // False once the kernel refused to commit pages (prefaulting has stopped).
  bool working() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until `bytes` (capped at the arena's) are committed, prefaulting stopped, or the
  // deadline passed; returns committed_bytes() >= the cap.
  bool WaitCommitted(size_t bytes, absl::Time deadline) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();
  // `bytes` from the base rounded up to whole pages, at most the arena's (whose last page the
  // mapping covers whole): madvise takes page-aligned ranges.
  size_t PageEnd(size_t bytes) const;

  uint8_t* const base_;
  const size_t bytes_;
  const size_t ahead_bytes_;
  const size_t page_bytes_;
  // Set by Reached and the destructor, read by the thread; `signal_` counts their changes, the
  // word the thread sleeps on (std::atomic::wait: a futex, no lock shared with the store).
  std::atomic<size_t> wanted_{0};  // commit [0, wanted_)
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> signal_{0};
  // The thread's progress, for tests and waiters (the thread takes mu_ after each piece; the
  // store never does).
  mutable absl::Mutex mu_;
  size_t committed_ ABSL_GUARDED_BY(mu_) = 0;  // [0, committed_) is committed
  bool working_ ABSL_GUARDED_BY(mu_) = true;
  std::thread thread_;  // last: started once the fields above are set
};

}  // namespace infinigen
