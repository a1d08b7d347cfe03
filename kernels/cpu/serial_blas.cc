#include "kernels/cpu/serial_blas.h"

#include <omp.h>

extern "C" void openblas_set_num_threads(int num_threads);

namespace infinigen::cpu {

void SerialBlas() {
  thread_local bool done = false;
  if (done) return;
  done = true;
  openblas_set_num_threads(1);
  omp_set_num_threads(1);
}

}  // namespace infinigen::cpu
