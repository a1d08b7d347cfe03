// ParallelFor: the kernels' parallel loop. It runs body(i) for i in [0, n) on the OpenMP team
// (static schedule, as `omp parallel for`) when `parallel` holds, and otherwise on the calling
// thread without entering OpenMP at all: an `omp parallel for if (false)` region, or one nested in
// another region, still has libgomp start a team of one, which cost 0.32 µs a region on the
// project VM against 0.79 µs for an active one (bench/omp_region_bench.cc), and a CPU decode
// token entered ~360 such regions (docs/benchmarks.md, "Where OpenMP's time goes"). Which
// thread runs an iteration never changes its arithmetic.
#pragma once

#include <omp.h>

#include <cstdint>

namespace infinigen::cpu {

template <typename Body>
inline void ParallelFor(int64_t n, bool parallel, const Body& body) {
  if (!parallel || n <= 1 || omp_in_parallel()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) body(i);
}

}  // namespace infinigen::cpu
