// ParallelFor: the kernels' parallel loop. It runs body(i) for i in [0, n) on the process's team
// (kernels/cpu/team.h: static shares, as `omp parallel for`) when `parallel` holds, and otherwise
// on the calling thread. A loop too small for the team stays on the caller: even a team's
// hand-off and join cost more than a few hundred multiply-adds. Which thread runs an iteration
// never changes its arithmetic.
#pragma once

#include <cstdint>

#include "kernels/cpu/team.h"

namespace infinigen::cpu {

template <typename Body>
inline void ParallelFor(int64_t n, bool parallel, const Body& body) {
  if (!parallel || n <= 1) return Team::RunHere(n, body);
  Team::Get().Run(n, body);
}

// As ParallelFor, but each thread takes the next index when it finishes one: for iterations of
// very different cost (the causal attention's query blocks).
template <typename Body>
inline void ParallelForDynamic(int64_t n, bool parallel, const Body& body) {
  if (!parallel || n <= 1) return Team::RunHere(n, body);
  Team::Get().Run(n, body, Schedule::kDynamic);
}

// As ParallelFor, but a thread that finishes its share takes the indices still left at the back
// of the others' (Team's stealing schedule): for a memory-bound loop whose threads run at
// different speeds (a GEMV), each thread still streams one contiguous range.
template <typename Body>
inline void ParallelForStealing(int64_t n, bool parallel, const Body& body) {
  if (!parallel || n <= 1) return Team::RunHere(n, body);
  Team::Get().Run(n, body, Schedule::kStealing);
}

// body(begin, end) over [0, n) cut into one range per thread of the team, each a multiple of
// `align` long but the last: for a library call per range (OpenBLAS, single-threaded, on a slab
// of a weight's rows) rather than per index.
template <typename Body>
inline void ParallelRanges(int64_t n, int64_t align, bool parallel, const Body& body) {
  const int64_t threads = parallel ? Team::Get().size() : 1;
  const int64_t units = (n + align - 1) / align;
  const int64_t ranges = units < threads ? units : threads;
  if (ranges <= 1) {
    if (n > 0) body(int64_t{0}, n);  // one range: the caller's library call as it is
    return;
  }
  Team::Get().Run(ranges, [&](int64_t r) {
    const int64_t begin = units * r / ranges * align;
    const int64_t end = units * (r + 1) / ranges * align;
    body(begin, end < n ? end : n);
  });
}

}  // namespace infinigen::cpu
