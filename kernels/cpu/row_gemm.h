// Batch-invariant GEMM: every output element y[i, j] is one dot product x_i . w_j reduced in a
// fixed order, whatever the number of rows and whichever other rows share the call. A decode
// token's logits then do not depend on the batch it was served in (OpenBLAS picks different
// kernels, blockings and reduction orders for sgemv and for sgemm of different shapes). The
// canonical order of the float32 and bf16 weights: 8-element block b of k into accumulator
// b % 2 by FMA, the two summed lane-wise, a fixed horizontal sum, then the tail by scalar FMA;
// the block formats (q8, Q4_1, Q5_1, Q6_K) have int8_dot_gemm.cc's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <variant>

#include "kernels/cpu/packed_gemm.h"
#include "kernels/cpu/q4_1.h"
#include "kernels/cpu/q5_1.h"
#include "kernels/cpu/q6_k.h"

namespace infinigen::cpu {

// y[m, n] = x[m, k] . w[n, k]^T + bias[n] (+ y when accumulate); bias may be null.
void GemmRowsF32(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias,
                 float* y, int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);
// The same with bf16 weights [n, k] (row stride k), widened exactly to float32 per panel.
void GemmRowsBf16(const float* x, int64_t ldx, const uint16_t* w, const float* bias, float* y,
                  int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);
// The same with weight row j at w_rows[j] (rows anywhere: a row table).
void GemmRowsF32Table(const float* x, int64_t ldx, const float* const* w_rows, const float* bias,
                      float* y, int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);
// The same with bf16 weight row j at w_rows[j] (a row table of bfloat16 rows).
void GemmRowsBf16Table(const float* x, int64_t ldx, const uint16_t* const* w_rows,
                       const float* bias, float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                       bool accumulate);
// The block formats (k a multiple of 32) on x rows quantized to 8 bits per block of 32 (scale
// max|x| / 127, round to nearest even), each block's dot product in integers, in the fixed
// order of kernels/cpu/int8_dot.h, equal for every row count and instruction set:
// Q8 (packed_gemm.h): y = sum over blocks of d dx (q_w . q_x);
void GemmRowsQ8(const float* x, int64_t ldx, const Q8Matrix& w, const float* bias, float* y,
                int64_t ldy, int64_t m, bool accumulate);
// Q4_1 (q4_1.h) and Q5_1 (q5_1.h): y = sum over blocks of d dx (q_w . q_x) + m dx sum(q_x).
void GemmRowsQ4_1(const float* x, int64_t ldx, const Q4_1Matrix& w, const float* bias, float* y,
                  int64_t ldy, int64_t m, bool accumulate);
void GemmRowsQ5_1(const float* x, int64_t ldx, const Q5_1Matrix& w, const float* bias, float* y,
                  int64_t ldy, int64_t m, bool accumulate);
// Q6_K (q6_k.h; k must be a multiple of 256, unchecked in release builds): y = sum over 4-weight
// lanes of d s dx ((q_w - 32) . q_x) (the 4 lanes of a group of 16 share its d s).
void GemmRowsQ6_K(const float* x, int64_t ldx, const Q6_KMatrix& w, const float* bias, float* y,
                  int64_t ldy, int64_t m, bool accumulate);

// One part of a weight whose rows come in parts of different block formats (q, k and v, or
// gate and up, each as its file stores it), and the part's bias (or null) and first output
// column.
using BlockMatrix = std::variant<Q8Matrix, Q4_1Matrix, Q5_1Matrix, Q6_KMatrix>;
struct BlockPart {
  BlockMatrix matrix;
  const float* bias = nullptr;
  float* y = nullptr;
};
// Each part's GEMM above (the same bits) as one parallel job, x quantized once per layout: one
// hand-off to the threads and one join for all the parts instead of one each. Every part has
// the same k. More than kMaxBlockParts parts run as one job each.
inline constexpr size_t kMaxBlockParts = 8;
void GemmRowsParts(const float* x, int64_t ldx, std::span<const BlockPart> parts, int64_t ldy,
                   int64_t m, bool accumulate);

// Every GEMM's first step: y's m rows of n set to bias (or 0), or bias added when accumulate.
void InitGemmOutput(const float* bias, float* y, int64_t ldy, int64_t m, int64_t n,
                    bool accumulate);

}  // namespace infinigen::cpu
