// The CPU kernels' team (kernels/cpu/team.h): every index runs exactly once, on the team's
// threads, whatever the share; a job inside a job, or beside another thread's job, runs on its
// caller; Configure resizes and pins. A kernel's rows computed split across the team equal the
// same rows computed alone on the caller, bit for bit (the scripts/sanitize.sh TSan stage runs
// these cases with a team of several threads).
#include "kernels/cpu/team.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/q4_1.h"
#include "kernels/cpu/row_gemm.h"

namespace infinigen::cpu {
namespace {

class TeamTest : public ::testing::Test {
 protected:
  void TearDown() override { Team::Get().Configure({}); }
};

std::vector<int> RunCounts(int64_t n, Schedule schedule) {
  std::vector<std::atomic<int>> counts(static_cast<size_t>(n));
  Team::Get().Run(
      n, [&](int64_t i) { counts[i].fetch_add(1); }, schedule);
  std::vector<int> out;
  for (auto& c : counts) out.push_back(c.load());
  return out;
}

TEST_F(TeamTest, EveryIndexRunsOnceWhateverTheShare) {
  Team::Get().Configure({.threads = 3, .pinning = Pinning::kOff});
  ASSERT_EQ(Team::Get().size(), 3);
  for (int64_t n : {1, 2, 3, 5, 64, 1001}) {
    for (Schedule schedule : {Schedule::kStatic, Schedule::kDynamic, Schedule::kStealing}) {
      const std::vector<int> counts = RunCounts(n, schedule);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(counts[i], 1) << "n " << n << " index " << i << " schedule "
                                << static_cast<int>(schedule);
      }
    }
  }
}

TEST_F(TeamTest, JobsRunOnTheTeamsThreadsAndTheCaller) {
  Team::Get().Configure({.threads = 3, .pinning = Pinning::kOff});
  std::mutex mu;
  std::set<std::thread::id> seen;
  // Static shares: one contiguous range per thread, so three threads for three long indices.
  for (int round = 0; round < 20 && seen.size() < 3; ++round) {
    Team::Get().Run(3, [&](int64_t) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::lock_guard<std::mutex> l(mu);
      seen.insert(std::this_thread::get_id());
    });
  }
  EXPECT_EQ(seen.size(), 3u);
  EXPECT_TRUE(seen.count(std::this_thread::get_id()));
}

TEST_F(TeamTest, AJobInsideAJobRunsOnItsCaller) {
  Team::Get().Configure({.threads = 2, .pinning = Pinning::kOff});
  std::atomic<int> wrong{0}, total{0};
  Team::Get().Run(4, [&](int64_t) {
    const std::thread::id outer = std::this_thread::get_id();
    ParallelFor(100, true, [&](int64_t) {
      if (std::this_thread::get_id() != outer) wrong.fetch_add(1);
      total.fetch_add(1);
    });
  });
  EXPECT_EQ(total.load(), 400);
  EXPECT_EQ(wrong.load(), 0);
}

// jobs() counts the loops the team's threads joined: not one run on the caller alone.
TEST_F(TeamTest, JobsCountOnlyTheLoopsTheTeamRan) {
  Team::Get().Configure({.threads = 2, .pinning = Pinning::kOff});
  Team& team = Team::Get();
  std::atomic<int> total{0};
  const uint64_t before = team.jobs();
  team.Run(8, [&](int64_t) { total.fetch_add(1); });
  EXPECT_EQ(team.jobs(), before + 1);
  team.Run(1, [&](int64_t) { total.fetch_add(1); });            // one index: the caller's
  ParallelFor(8, false, [&](int64_t) { total.fetch_add(1); });  // too small for the team
  EXPECT_EQ(team.jobs(), before + 1);
  team.Run(4, [&](int64_t) { ParallelFor(8, true, [&](int64_t) { total.fetch_add(1); }); });
  EXPECT_EQ(team.jobs(), before + 2);  // the nested loops ran on their callers
  EXPECT_EQ(total.load(), 8 + 1 + 8 + 32);
  Team::Get().Configure({.threads = 1, .pinning = Pinning::kOff});
  team.Run(8, [&](int64_t) { total.fetch_add(1); });
  EXPECT_EQ(team.jobs(), before + 2);
}

TEST_F(TeamTest, TwoCallersAtOnceBothFinishEveryIndex) {
  Team::Get().Configure({.threads = 2, .pinning = Pinning::kOff, .spin_us = 50});
  std::atomic<int64_t> sums[2] = {0, 0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 2; ++c) {
    callers.emplace_back([&, c] {
      for (int job = 0; job < 2000; ++job) {
        ParallelFor(16, true, [&](int64_t i) { sums[c].fetch_add(i + 1); });
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(sums[0].load(), 2000 * 136);
  EXPECT_EQ(sums[1].load(), 2000 * 136);
}

// Stealing: while one thread is held on its first index, the other runs its own share and then
// the held thread's remaining indices (from the back), in both directions: the caller taking the
// team thread's share and the team thread the caller's. The held thread is released once the
// other has run 5 of the 8 indices, or after 10 s, when stealing did not happen (the test then
// fails instead of hanging).
TEST_F(TeamTest, AThreadHeldOnItsShareHasTheRestTakenByTheOther) {
  Team::Get().Configure({.threads = 2, .pinning = Pinning::kOff});
  ASSERT_EQ(Team::Get().size(), 2);
  const std::thread::id caller = std::this_thread::get_id();
  for (bool hold_caller : {false, true}) {
    SCOPED_TRACE(hold_caller ? "the caller held" : "the team's thread held");
    std::atomic<int> by_caller[8];
    std::atomic<int> runs[8];
    for (int i = 0; i < 8; ++i) by_caller[i] = runs[i] = 0;
    std::atomic<int> by_free{0};  // indices run by the thread not held
    std::atomic<bool> held{false};
    Team::Get().Run(
        8,
        [&](int64_t i) {
          const bool on_caller = std::this_thread::get_id() == caller;
          runs[i].fetch_add(1);
          by_caller[i] = on_caller ? 1 : 0;
          if (on_caller != hold_caller) {
            by_free.fetch_add(1);
            return;
          }
          if (held.exchange(true)) return;  // only the held thread's first index waits
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
          while (by_free.load() < 5 && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::microseconds(50));
          }
        },
        Schedule::kStealing);
    for (int i = 0; i < 8; ++i) ASSERT_EQ(runs[i].load(), 1) << "index " << i;
    // The free thread ran its own share of 4 and at least one of the held thread's.
    EXPECT_GE(by_free.load(), 5);
    int taken = 0;  // indices of the held thread's share run by the other
    for (int i = 0; i < 8; ++i) {
      const bool held_share = hold_caller ? i < 4 : i >= 4;
      if (held_share && by_caller[i].load() != (hold_caller ? 1 : 0)) ++taken;
    }
    EXPECT_GE(taken, 1);
  }
}

TEST_F(TeamTest, SleepingThreadsWakeForTheNextJob) {
  // No spinning: every job wakes threads that went to sleep on the futex.
  Team::Get().Configure({.threads = 2, .pinning = Pinning::kOff, .spin_us = 0});
  for (int job = 0; job < 200; ++job) {
    const Schedule schedule = static_cast<Schedule>(job % 3);
    ASSERT_EQ(RunCounts(7, schedule), std::vector<int>(7, 1)) << "job " << job;
    if (job % 50 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

TEST_F(TeamTest, PinnedThreadsStayOnOneCpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  if (CPU_COUNT(&set) < 2) GTEST_SKIP() << "one CPU: nothing to pin";
  Team::Get().Configure({.threads = 2, .pinning = Pinning::kOn});
  EXPECT_TRUE(Team::Get().pinned());
  std::atomic<int> worker_cpus{-1};
  const std::thread::id caller = std::this_thread::get_id();
  Team::Get().Run(2, [&](int64_t) {
    if (std::this_thread::get_id() == caller) return;
    cpu_set_t mine;
    CPU_ZERO(&mine);
    sched_getaffinity(0, sizeof(mine), &mine);
    worker_cpus = CPU_COUNT(&mine);
  });
  EXPECT_EQ(worker_cpus.load(), 1);

  Team::Get().Configure({.threads = 2, .pinning = Pinning::kOff});
  EXPECT_FALSE(Team::Get().pinned());
}

TEST_F(TeamTest, OneThreadRunsOnTheCaller) {
  Team::Get().Configure({.threads = 1});
  EXPECT_EQ(Team::Get().size(), 1);
  std::atomic<int> other{0};
  const std::thread::id caller = std::this_thread::get_id();
  ParallelFor(50, true, [&](int64_t) { other += std::this_thread::get_id() != caller; });
  EXPECT_EQ(other.load(), 0);
}

// A batch large enough for the team (its GEMMs split across 3 threads, the activations quantized
// in parallel) against each of its rows alone, small enough to stay on the caller: one compiled
// copy of every loop body, so the same arithmetic (a body inlined twice may contract a * b + c
// into FMAs differently in each copy; batch_invariance_test found that once).
TEST_F(TeamTest, RowsSplitAcrossTheTeamEqualThemselvesAloneOnTheCaller) {
  constexpr int64_t m = 24, n = 96, k = 256;
  static_assert(m * n * k > (1 << 16) && n * k <= (1 << 16), "batch on the team, a row alone not");
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(m * k), w(n * k), bias(n);
  for (float& v : x) v = dist(rng);
  for (float& v : w) v = dist(rng);
  for (float& v : bias) v = dist(rng);
  std::vector<uint8_t> qs(n * k / 2);
  std::vector<float> d(n * k / kQ4Block), mins(n * k / kQ4Block);
  QuantizeQ4_1(w.data(), n, k, qs.data(), d.data(), mins.data());
  const Q4_1Matrix q4{qs.data(), d.data(), mins.data(), n, k};
  auto gemm = [&](int format, const float* rows, int64_t count, float* y) {
    if (format == 0) {
      GemmRowsF32(rows, k, w.data(), k, bias.data(), y, n, count, n, k, false);
    } else {
      GemmRowsQ4_1(rows, k, q4, bias.data(), y, n, count, false);
    }
  };
  for (int format : {0, 1}) {
    Team::Get().Configure({.threads = 3, .pinning = Pinning::kOff});
    std::vector<float> batch(m * n);
    gemm(format, x.data(), m, batch.data());
    Team::Get().Configure({.threads = 1});
    for (int64_t i = 0; i < m; ++i) {
      std::vector<float> alone(n);
      gemm(format, x.data() + i * k, 1, alone.data());
      ASSERT_EQ(std::memcmp(alone.data(), batch.data() + i * n, n * sizeof(float)), 0)
          << (format == 0 ? "f32" : "q4_1") << ", row " << i;
    }
  }
}

}  // namespace
}  // namespace infinigen::cpu
