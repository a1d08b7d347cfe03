// GEMM through OpenBLAS (cblas). Weights are [out_features, in_features] as checkpoints store
// them, so the product is x · wᵀ.
#include <cblas.h>

#include <cstring>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/serial_blas.h"

namespace infinigen::cpu {

void Gemm(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias, float* y,
          int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  float beta = accumulate ? 1.0f : 0.0f;
  if (bias != nullptr && !accumulate) {
    for (int64_t r = 0; r < m; ++r) std::memcpy(y + r * ldy, bias, n * 4);
    beta = 1.0f;
  } else if (bias != nullptr) {
    for (int64_t r = 0; r < m; ++r) {
      float* yr = y + r * ldy;
      for (int64_t i = 0; i < n; ++i) yr[i] += bias[i];
    }
  }
  // OpenBLAS runs single-threaded (SerialBlas): the team splits the weight's rows.
  ParallelRanges(n, 16, m * n * k >= (1 << 16), [&](int64_t j0, int64_t j1) {
    SerialBlas();
    if (m == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, j1 - j0, k, 1.0f, w + j0 * ldw, ldw, x, 1, beta,
                  y + j0, 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, j1 - j0, k, 1.0f, x, ldx,
                  w + j0 * ldw, ldw, beta, y + j0, ldy);
    }
  });
}

}  // namespace infinigen::cpu
