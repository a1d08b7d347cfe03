// Team: the threads the CPU kernels run on, one team for the process, started once and kept.
//
// A CPU decode step is a chain of short kernels (a GEMV, a norm, RoPE, attention over a few
// chunks, the InfiniGen choice), each split over the threads and joined before the next begins.
// With OpenMP every kernel was a parallel region: libgomp's fork and join cost 0.79 µs a region on
// the project VM, and a token entered 140 to 513 of them (docs/benchmarks.md, "Where OpenMP's time
// goes"). A team's threads instead stay awake between kernels: the caller publishes a job on one
// cache line, takes the first share itself, and waits on another until the threads have counted
// their shares in, so a
// kernel costs what a barrier inside one parallel region costs, and a whole decode step runs as
// one region whose kernels are its phases. Threads that find no job for `spin_us` sleep on a
// futex; the next job wakes them.
//
// The caller is thread 0; threads 1..size-1 are the team's own. Shares are static (thread t runs
// [n*t/size, n*(t+1)/size)), dynamic (indices taken one at a time), or stealing (thread t takes
// the indices of its static share one at a time, in order, then those still left in the other
// threads' shares: a contiguous stream each, and no thread idle while another has work left);
// which thread runs an index never changes its arithmetic. (A thread takes the others' indices
// from the back: their own streams go on undisturbed.) A job started inside a job (a kernel
// called from a parallel body), or while another thread's job runs, runs on the calling thread
// alone.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace infinigen::cpu {

enum class Pinning {
  kAuto,  // OMP_PROC_BIND if set; otherwise pin when the team has exactly the CPUs it may run on
  kOn,    // thread t on the t-th CPU this process may run on (the caller's is left to it)
  kOff,
};

struct TeamOptions {
  int threads = 0;  // 0: OMP_NUM_THREADS if set, else the CPUs this process may run on
  Pinning pinning = Pinning::kAuto;
  // How long an idle thread spins before it sleeps, and how long the caller spins on a join
  // before it sleeps; -1: from OMP_WAIT_POLICY (PASSIVE 0, ACTIVE 10 ms, unset 300 µs).
  int spin_us = -1;
};

enum class Schedule { kStatic, kDynamic, kStealing };

class Team {
 public:
  // The process's team, started with TeamOptions{} on first use.
  static Team& Get();

  // Stops the threads and starts them again with `options` (after a running job ends). Not from
  // inside a job: that would wait for itself (the process aborts, saying so).
  void Configure(const TeamOptions& options);
  int size() const { return size_.load(std::memory_order_relaxed); }
  bool pinned() const { return pinned_.load(std::memory_order_relaxed); }
  // Jobs the team has run since the process started; a loop run on its caller alone (n == 1, a
  // job inside a job, a team of one) is not one. A decode step's count of these is its count of
  // barriers (`infinigen bench` reports it per token).
  uint64_t jobs() const { return jobs_.load(std::memory_order_relaxed); }

  // body(i) for every i in [0, n), on the team when it is free, otherwise on the caller.
  template <typename Body>
  void Run(int64_t n, const Body& body, Schedule schedule = Schedule::kStatic) {
    if (n <= 0) return;
    if (n == 1 || !Dispatch(n, &body, &Thunk<Body>, schedule)) Thunk<Body>(&body, 0, n);
  }
  // body(i) for every i in [0, n) on the calling thread, through the same code as Run.
  template <typename Body>
  static void RunHere(int64_t n, const Body& body) {
    if (n > 0) Thunk<Body>(&body, 0, n);
  }

 private:
  using ThunkFn = void (*)(const void* body, int64_t begin, int64_t end);
  // The one compiled copy of a loop body, whichever thread runs it and whether or not the loop
  // is split: GCC contracts a * b + c into an FMA (-ffp-contract=fast, its default) as each copy
  // of inlined code allows, so a body inlined at a serial call site and again in a parallel one
  // could round differently, and a row's result would then depend on the batch it came in
  // (a batch-invariance failure the router's resume test caught). noipa: neither inlined nor
  // cloned. noexcept: a body that throws ends the process, on the caller as on the team's threads
  // (unwinding the caller would free what the other shares are still reading).
  template <typename Body>
#if defined(__clang__)
  __attribute__((noinline))
#else
  __attribute__((noipa))
#endif
  static void
  Thunk(const void* body, int64_t begin, int64_t end) noexcept {
    const Body& b = *static_cast<const Body*>(body);
    for (int64_t i = begin; i < end; ++i) b(i);
  }

  Team() = default;
  // Runs the job on the team and returns true, or returns false having run nothing.
  bool Dispatch(int64_t n, const void* body, ThunkFn thunk, Schedule schedule);
  void Start(const TeamOptions& options);  // run_mu_ held
  void Stop();                             // run_mu_ held
  void Share(int thread);
  void Worker(int thread, uint32_t epoch, int cpu);
  uint32_t Await(uint32_t seen);

  std::mutex run_mu_;  // one job at a time; held by Configure
  std::atomic<int> size_{1};
  std::atomic<bool> pinned_{false};
  std::atomic<uint64_t> jobs_{0};  // written by the caller holding run_mu_
  int64_t spin_ns_ = 0;
  std::vector<std::thread> threads_;
  uint32_t done_target_ = 0;  // the caller's: done_.shares once the current job's are in

  // A job costs two cache-line transfers between the caller and each thread: this line, which
  // the caller writes (the job, published by moving epoch) and the threads read, and the next,
  // which the threads write (their finished shares) and the caller reads.
  struct alignas(64) Job {
    std::atomic<uint32_t> epoch{0};
    std::atomic<int> sleepers{0};  // threads asleep on epoch
    int workers = 0;               // the team's threads besides the caller
    Schedule schedule = Schedule::kStatic;
    bool stop = false;
    const void* body = nullptr;
    ThunkFn thunk = nullptr;
    int64_t n = 0;
  } job_;
  struct alignas(64) Done {
    std::atomic<uint32_t> shares{0};  // shares finished since the team started, wrapping
    std::atomic<bool> caller_sleeping{false};
    std::atomic<int64_t> next{0};  // the next index of a dynamic job
  } done_;
  // A stealing job's indices not yet taken of each thread's share, [front, back) packed as
  // front << 32 | back (the owner takes the front, the others the back), one cache line each
  // (Start sizes it).
  struct alignas(64) Cursor {
    std::atomic<uint64_t> range{0};
  };
  // Takes the front (owner) or back index of `c`'s range, or returns -1 when it is empty.
  static int64_t Take(Cursor& c, bool front);
  std::unique_ptr<Cursor[]> cursors_;
};

}  // namespace infinigen::cpu
