// What one OpenMP parallel region costs on this machine (component micro-benchmark): a region
// whose two iterations do nothing, with the team active (every thread takes part) and with an
// `if` clause that is false (libgomp still starts a team of one). A CPU decode step enters about
// 500 regions a token (docs/benchmarks.md, "Where OpenMP's time goes"), so this times what a
// single region per layer would save.
//
// usage: omp_region_bench [--benchmark_repetitions=3 ...] (OMP_NUM_THREADS sets the team)
#include <benchmark/benchmark.h>
#include <omp.h>

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

}  // namespace

BENCHMARK_MAIN();
