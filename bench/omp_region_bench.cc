// What splitting a loop over the CPU's threads costs on this machine (component micro-benchmark),
// a loop whose two iterations do nothing:
// - BM_Region: an OpenMP parallel region, with the team active (every thread takes part) and with
//   an `if` clause that is false (libgomp still starts a team of one);
// - BM_Team: the same loop on the kernels' team (kernels/cpu/team.h), whose threads stay awake
//   between jobs: a hand-off on one cache line and a join.
// A CPU decode step entered 140 to 513 OpenMP regions a token before the kernels moved to the
// team (docs/benchmarks.md, "Where OpenMP's time goes").
//
// usage: omp_region_bench [--benchmark_repetitions=3 ...] (OMP_NUM_THREADS sets both teams)
#include <benchmark/benchmark.h>
#include <omp.h>

#include "kernels/cpu/team.h"

namespace {

void BM_Region(benchmark::State& state) {
  const bool active = state.range(0) != 0;
  int sink = 0;
  for (auto _ : state) {
#pragma omp parallel for schedule(static) if (active) reduction(+ : sink)
    for (int j = 0; j < 2; ++j) sink += j;
    benchmark::DoNotOptimize(sink);
  }
  state.counters["threads"] = omp_get_max_threads();
}
BENCHMARK(BM_Region)->ArgName("active")->Arg(1)->Arg(0);

void BM_Team(benchmark::State& state) {
  infinigen::cpu::Team& team = infinigen::cpu::Team::Get();
  struct alignas(64) Slot {
    int v = 0;
  };
  Slot sink[2];
  for (auto _ : state) {
    team.Run(2, [&](int64_t j) { sink[j].v += static_cast<int>(j); });
  }
  benchmark::DoNotOptimize(sink[0].v + sink[1].v);
  state.counters["threads"] = team.size();
}
BENCHMARK(BM_Team);

}  // namespace

BENCHMARK_MAIN();
