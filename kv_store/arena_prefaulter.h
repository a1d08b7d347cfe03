// Commits the arena's pages ahead of the blocks the store hands out, on a thread of its own, so
// that no append waits for the kernel to fault its block in.
//
// Why: the arena is mapped without committing memory (a store's capacity is not its use), so the
// first write to each page faults. With transparent huge pages each fault zeroes (and may first
// compact) 2 MiB; in a VM each also faults the host. Measured on the project's 2-core VM: about
// 2.5 ms per MiB, 5 ms a huge page. A decode step whose tokens start new blocks in every layer
// (after a 4096-token prompt on SmolLM2: 180 blocks of 64 KiB) waited 30 ms for them, on top of
// its 16 (docs/benchmarks.md). Blocks freed by closed sequences are reused first (the arena's
// free list is LIFO), so fresh pages are needed only past the highest block ever handed out, and
// the arena hands those out in address order: this commits [0, high water + ahead).
//
// How: madvise(MADV_POPULATE_WRITE) (Linux 5.14), which commits pages without writing to them, so
// it may run while the store writes rows into the same pages. On an older kernel it is refused
// and prefaulting stops (the store works as before).
#pragma once

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
  // mark reported, up to `bytes`. `base` must stay mapped until this is destroyed.
  ArenaPrefaulter(uint8_t* base, size_t bytes, size_t ahead_bytes);
  ~ArenaPrefaulter();  // stops the thread (a piece in progress finishes first)
  ArenaPrefaulter(const ArenaPrefaulter&) = delete;
  ArenaPrefaulter& operator=(const ArenaPrefaulter&) = delete;

  // The arena's blocks now reach `high_water_bytes` from its base. Cheap; never waits for pages.
  void Reached(size_t high_water_bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // Bytes from the base known to be committed.
  size_t committed_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // False once the kernel refused to commit pages (prefaulting has stopped).
  bool working() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until `bytes` (capped at the arena's) are committed, prefaulting stopped, or the
  // deadline passed; returns committed_bytes() >= the cap.
  bool WaitCommitted(size_t bytes, absl::Time deadline) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();

  uint8_t* const base_;
  const size_t bytes_;
  const size_t ahead_bytes_;
  mutable absl::Mutex mu_;
  size_t wanted_ ABSL_GUARDED_BY(mu_) = 0;     // commit [0, wanted_)
  size_t committed_ ABSL_GUARDED_BY(mu_) = 0;  // [0, committed_) is committed
  bool working_ ABSL_GUARDED_BY(mu_) = true;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the fields above are set
};

}  // namespace infinigen
