#include "kernels/cpu/team.h"

#include <pthread.h>
#include <sched.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace infinigen::cpu {
namespace {

thread_local bool in_job = false;  // this thread runs a share: a nested job runs here alone

inline void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Spins until done() or `spin_ns` have passed; returns done().
template <typename Done>
bool SpinUntil(int64_t spin_ns, const Done& done) {
  if (done()) return true;
  if (spin_ns <= 0) return false;
  const int64_t end = NowNs() + spin_ns;
  for (;;) {
    for (int i = 0; i < 32; ++i) {
      if (done()) return true;
      Relax();
    }
    if (NowNs() >= end) return done();
  }
}

std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  std::string s = v == nullptr ? "" : v;
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

Team& Team::Get() {
  // Never destroyed: kernels may run until the process exits.
  static Team* const team = [] {
    auto* t = new Team;
    std::lock_guard<std::mutex> l(t->run_mu_);
    t->Start(TeamOptions{});
    return t;
  }();
  return *team;
}

void Team::Configure(const TeamOptions& options) {
  if (in_job) {
    std::fprintf(stderr, "cpu::Team::Configure called from inside a job: it would deadlock\n");
    std::abort();
  }
  std::lock_guard<std::mutex> l(run_mu_);
  Stop();
  Start(options);
}

void Team::Start(const TeamOptions& options) {
  const std::vector<int> cpus = AllowedCpus();
  int threads = options.threads;
  if (threads <= 0) threads = std::atoi(Env("OMP_NUM_THREADS").c_str());
  if (threads <= 0) threads = cpus.empty() ? 1 : static_cast<int>(cpus.size());

  bool pin = false;
  switch (options.pinning) {
    case Pinning::kOn:
      pin = true;
      break;
    case Pinning::kOff:
      break;
    case Pinning::kAuto: {
      const std::string bind = Env("OMP_PROC_BIND");
      if (bind.empty()) {
        pin = threads > 1 && static_cast<size_t>(threads) == cpus.size();
      } else {
        pin = bind != "false";
      }
      break;
    }
  }
  pin = pin && cpus.size() > 1;

  int64_t spin_us = options.spin_us;
  if (spin_us < 0) {
    const std::string wait = Env("OMP_WAIT_POLICY");
    spin_us = wait == "passive" ? 0 : wait == "active" ? 10000 : 300;
  }
  spin_ns_ = spin_us * 1000;
  size_.store(threads, std::memory_order_relaxed);
  pinned_.store(pin, std::memory_order_relaxed);
  job_.stop = false;
  job_.workers = threads - 1;
  cursors_ = std::make_unique<Cursor[]>(static_cast<size_t>(threads));
  done_target_ = done_.shares.load(std::memory_order_relaxed);
  const uint32_t epoch = job_.epoch.load(std::memory_order_relaxed);
  for (int t = 1; t < threads; ++t) {
    const int cpu = pin ? cpus[static_cast<size_t>(t) % cpus.size()] : -1;
    threads_.emplace_back([this, t, epoch, cpu] { Worker(t, epoch, cpu); });
  }
}

void Team::Stop() {
  if (threads_.empty()) return;
  job_.stop = true;
  job_.epoch.fetch_add(1, std::memory_order_seq_cst);
  job_.epoch.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  job_.stop = false;
  job_.workers = 0;
}

bool Team::Dispatch(int64_t n, const void* body, ThunkFn thunk, Schedule schedule) {
  if (in_job) return false;
  std::unique_lock<std::mutex> lock(run_mu_, std::try_to_lock);
  if (!lock.owns_lock() || job_.workers == 0) return false;
  jobs_.fetch_add(1, std::memory_order_relaxed);
  // A stealing job's ranges pack two 32-bit indices.
  if (schedule == Schedule::kStealing && n > int64_t{0xffffffff}) schedule = Schedule::kDynamic;
  job_.body = body;
  job_.thunk = thunk;
  job_.n = n;
  job_.schedule = schedule;
  if (schedule == Schedule::kDynamic) done_.next.store(0, std::memory_order_relaxed);
  if (schedule == Schedule::kStealing) {
    const int64_t size = job_.workers + 1;
    for (int64_t t = 0; t < size; ++t) {
      const uint64_t front = static_cast<uint64_t>(n * t / size);
      const uint64_t back = static_cast<uint64_t>(n * (t + 1) / size);
      cursors_[t].range.store(front << 32 | back, std::memory_order_relaxed);
    }
  }
  done_target_ += static_cast<uint32_t>(job_.workers);
  job_.epoch.fetch_add(1, std::memory_order_seq_cst);
  if (job_.sleepers.load(std::memory_order_seq_cst) > 0) job_.epoch.notify_all();

  in_job = true;
  Share(0);
  in_job = false;

  const uint32_t target = done_target_;
  const auto finished = [&](uint32_t shares) { return static_cast<int32_t>(shares - target) >= 0; };
  const auto done = [&] { return finished(done_.shares.load(std::memory_order_acquire)); };
  if (!SpinUntil(spin_ns_, done)) {
    done_.caller_sleeping.store(true, std::memory_order_seq_cst);
    for (uint32_t s; !finished(s = done_.shares.load(std::memory_order_seq_cst));) {
      done_.shares.wait(s);
    }
    done_.caller_sleeping.store(false, std::memory_order_relaxed);
  }
  return true;
}

void Team::Share(int thread) {
  const int64_t n = job_.n;
  const int64_t size = job_.workers + 1;
  if (job_.schedule == Schedule::kDynamic) {
    for (int64_t i; (i = done_.next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      job_.thunk(job_.body, i, i + 1);
    }
    return;
  }
  if (job_.schedule == Schedule::kStealing) {  // its own share first, then the others' rest
    for (int64_t k = 0; k < size; ++k) {
      Cursor& c = cursors_[(thread + k) % size];
      for (int64_t i; (i = Take(c, /*front=*/k == 0)) >= 0;) job_.thunk(job_.body, i, i + 1);
    }
    return;
  }
  const int64_t begin = n * thread / size, end = n * (thread + 1) / size;
  if (begin < end) job_.thunk(job_.body, begin, end);
}

int64_t Team::Take(Cursor& c, bool front) {
  uint64_t r = c.range.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t f = r >> 32, b = r & 0xffffffffu;
    if (f >= b) return -1;
    const uint64_t taken = front ? (f + 1) << 32 | b : f << 32 | (b - 1);
    if (c.range.compare_exchange_weak(r, taken, std::memory_order_relaxed)) {
      return static_cast<int64_t>(front ? f : b - 1);
    }
  }
}

uint32_t Team::Await(uint32_t seen) {
  uint32_t e = seen;
  const auto moved = [&] { return (e = job_.epoch.load(std::memory_order_acquire)) != seen; };
  if (SpinUntil(spin_ns_, moved)) return e;
  job_.sleepers.fetch_add(1, std::memory_order_seq_cst);
  while ((e = job_.epoch.load(std::memory_order_seq_cst)) == seen) job_.epoch.wait(seen);
  job_.sleepers.fetch_sub(1, std::memory_order_relaxed);
  return e;
}

void Team::Worker(int thread, uint32_t epoch, int cpu) {
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
  }
  in_job = true;
  for (uint32_t seen = epoch;;) {
    seen = Await(seen);
    if (job_.stop) return;
    Share(thread);
    done_.shares.fetch_add(1, std::memory_order_seq_cst);
    if (done_.caller_sleeping.load(std::memory_order_seq_cst)) done_.shares.notify_one();
  }
}

}  // namespace infinigen::cpu
