// GGUF's Q6_K weight format, its values kept as the file has them: super-blocks of 256 weights
// of a row with a float16 scale d (held as float32), an int8 scale s per 16 weights and 6-bit
// values q; a weight is (d s) (q - 32) in float32, the reference's order. Laid out for the
// integer dot products of kernels/cpu/int8_dot.h, per pair of blocks of 32 (the nibble
// formats' pair order: group 0 elements 0-15 of the first block, group 1 elements 0-15 of the
// second, group 2 elements 16-31 of the first, group 3 elements 16-31 of the second):
//   ql: 16 bytes a block, Q4_1's layout of the low nibbles (byte j: element j low, j + 16 high);
//   qh: 16 bytes a pair, byte j holding group g's element j's two high bits at bits 2g, 2g + 1;
//   s:  4 int8 scales a pair, one per group;
//   d:  one float a super-block (8 blocks).
// 6.6 bits a weight against Q8's 9 (the file's Q6_K: 6.56).
#pragma once

#include <cstdint>

namespace infinigen::cpu {

constexpr int64_t kQ6Block = 32;
constexpr int64_t kQ6Super = 256;

// A [rows, cols] Q6_K matrix (cols a multiple of kQ6Super): row r's block b is block index
// at = r * cols / 32 + b; its nibbles at ql + 16 at; its pair's (at / 2) high bits at
// qh + 16 (at / 2) and scales at s + 4 (at / 2); its super-block's d at d[at / 8].
struct Q6_KMatrix {
  const uint8_t* ql = nullptr;
  const uint8_t* qh = nullptr;
  const int8_t* s = nullptr;
  const float* d = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

// The 6-bit value (0-63) of row r's element c, and its scale d s.
int Q6_KValue(const Q6_KMatrix& w, int64_t r, int64_t c);
float Q6_KScale(const Q6_KMatrix& w, int64_t r, int64_t c);

// Row r widened to float32 (an embedding's rows; GemmRowsQ6_K multiplies the values as integers).
void WidenQ6_KRow(const Q6_KMatrix& w, int64_t r, float* out);

// out[i, :] = row ids[i] of the table, widened.
void EmbeddingQ6_K(const Q6_KMatrix& table, const int32_t* ids, int64_t n, float* out,
                   int64_t out_stride);

}  // namespace infinigen::cpu
