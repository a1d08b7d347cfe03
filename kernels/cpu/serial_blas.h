// SerialBlas: OpenBLAS on the calling thread alone, for the kernels that call it.
#pragma once

namespace infinigen::cpu {

// Makes OpenBLAS run on the calling thread alone; the kernels call it before each cblas call and
// split the work over the team themselves (a second pool of threads next to the team would spin
// against it on the same cores, and OpenBLAS's threads change its sums' order with the shape).
// Debian's OpenMP build of OpenBLAS takes its thread count from the calling thread's OpenMP
// setting (omp_get_max_threads), which every new thread starts at the core count, not from
// openblas_set_num_threads alone: both are set, once per thread.
void SerialBlas();

}  // namespace infinigen::cpu
