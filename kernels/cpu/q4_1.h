// GGUF's Q4_1 weight format, its values kept as the file has them: blocks of 32 weights of a row,
// each with a scale d and minimum m (float16 values, held as float32 so that a kernel reads them
// without converting) and 32 four-bit values q (byte j of a block: element j in its low nibble,
// element j + 16 in its high one). A weight is fma(q, d, m) in float32. Two thirds of the bytes
// of Q8 (6 bits a weight instead of 9), which is what a memory-bound decode step pays for. A
// matrix of the file's Q4_0 blocks may keep no minimums (m null): each is then -8 d, which the
// kernels make from d (exactly: a power of two times d), 5 bits a weight.
#pragma once

#include <cstdint>

namespace infinigen::cpu {

constexpr int64_t kQ4Block = 32;
// A Q4_0 block's minimum per unit of its scale: (q - 8) d = fma(q, d, -8 d).
constexpr float kQ4Centered = -8.0f;

// A [rows, cols] Q4_1 matrix: row r's block b at qs + (r * cols / 32 + b) * 16, its scale and
// minimum at d[r * cols / 32 + b], m[...] (-8 d[...] where m is null). cols must be a multiple of
// kQ4Block.
struct Q4_1Matrix {
  const uint8_t* qs = nullptr;
  const float* d = nullptr;
  const float* m = nullptr;  // null: every minimum is kQ4Centered d
  int64_t rows = 0;
  int64_t cols = 0;
};

// Q4_1 blocks of float32 weights as llama.cpp makes them: per block m = min, d = (max - min) / 15,
// both rounded to float16, then q = (w - m) / d rounded to the nearest integer in [0, 15] (ties
// to even; llama.cpp rounds them up). Weights decoded from a Q4_1 file (fma(q, d, m) or
// q * d + m) come back as the file's own blocks.
void QuantizeQ4_1(const float* w, int64_t rows, int64_t cols, uint8_t* qs, float* d, float* m);

// Row r widened to float32 (an embedding's rows; GemmRowsQ4_1 multiplies the values as integers).
void WidenQ4_1Row(const Q4_1Matrix& w, int64_t r, float* out);

// out[i, :] = row ids[i] of the table, widened.
void EmbeddingQ4_1(const Q4_1Matrix& table, const int32_t* ids, int64_t n, float* out,
                   int64_t out_stride);

}  // namespace infinigen::cpu
