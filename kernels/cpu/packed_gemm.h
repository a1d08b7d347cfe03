// GEMM with weights packed in a narrower format than the float32 activations: bfloat16, or
// Q8_0-style int8 with one float scale per 32 weights of a row. Decode on the CPU is a
// matrix-vector product bound by memory bandwidth, so halving (bf16) or quartering (int8) the
// weight bytes is what speeds it up. For more than 16 rows (prefill), panels of weights are
// widened to float32 and multiplied by OpenBLAS.
#pragma once

#include <cstdint>

namespace infinigen::cpu {

constexpr int64_t kQ8Block = 32;

// A [rows, cols] int8 matrix: w[r, c] = qs[r * cols + c] * scales[r * (cols / 32) + c / 32].
// cols must be a multiple of kQ8Block.
struct Q8Matrix {
  const int8_t* qs = nullptr;
  const float* scales = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

// Symmetric per-block quantization: scale = max|w| / 127, q = round(w / scale) to nearest even
// (a block holding a NaN: a NaN scale and zeros), as int8_dot_gemm.cc quantizes activations.
void QuantizeQ8(const float* w, int64_t rows, int64_t cols, int8_t* qs, float* scales);

// y[m, n] = x[m, k] · wᵀ + bias (+ y when accumulate), w: bf16 [n, k] (row stride k).
void GemmBf16(const float* x, int64_t ldx, const uint16_t* w, const float* bias, float* y,
              int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);
// The same with w in Q8 format ([n, k]). Up to 16 rows (decode batches) this is GemmRowsQ8
// (row_gemm.h: x quantized to int8 per block, integer dot products); more rows widen w to
// float32 for OpenBLAS.
void GemmQ8(const float* x, int64_t ldx, const Q8Matrix& w, const float* bias, float* y,
            int64_t ldy, int64_t m, bool accumulate);

// out[i, :] = row ids[i] of the packed table, widened to float32.
void EmbeddingBf16(const uint16_t* table, int64_t dim, const int32_t* ids, int64_t n, float* out,
                   int64_t out_stride);
void EmbeddingQ8(const Q8Matrix& table, const int32_t* ids, int64_t n, float* out,
                 int64_t out_stride);

}  // namespace infinigen::cpu
