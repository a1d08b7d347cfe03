// GGUF's Q5_1 weight format, its values kept as the file has them: blocks of 32 weights of a row,
// each with a scale d and minimum m (float16 values, held as float32 so that a kernel reads them
// without converting), 16 bytes of low nibbles laid out as Q4_1's (byte j: element j low,
// element j + 16 high) and a 32-bit word whose bit j is element j's fifth bit. A weight is
// fma(q, d, m) in float32. The file's Q5_0, Q5_1 and Q5_K blocks convert to these exactly
// (gpu_worker/model/storage_type.h): 7 bits a weight against Q8's 9. A matrix of the file's Q5_0
// blocks may keep no minimums (m null): each is then -16 d, which the kernels make from d
// (exactly: a power of two times d), 6 bits a weight.
#pragma once

#include <cstdint>

namespace infinigen::cpu {

constexpr int64_t kQ5Block = 32;
// A Q5_0 block's minimum per unit of its scale: (q - 16) d = fma(q, d, -16 d).
constexpr float kQ5Centered = -16.0f;

// A [rows, cols] Q5_1 matrix: row r's block b at index at = r * cols / 32 + b: its nibbles at
// qs + 16 at, its fifth bits qh[at], its scale and minimum d[at], m[at] (-16 d[at] where m is
// null). cols must be a multiple of kQ5Block.
struct Q5_1Matrix {
  const uint8_t* qs = nullptr;
  const uint32_t* qh = nullptr;
  const float* d = nullptr;
  const float* m = nullptr;  // null: every minimum is kQ5Centered d
  int64_t rows = 0;
  int64_t cols = 0;
};

// Row r widened to float32 (an embedding's rows; GemmRowsQ5_1 multiplies the values as integers).
void WidenQ5_1Row(const Q5_1Matrix& w, int64_t r, float* out);

// out[i, :] = row ids[i] of the table, widened.
void EmbeddingQ5_1(const Q5_1Matrix& table, const int32_t* ids, int64_t n, float* out,
                   int64_t out_stride);

}  // namespace infinigen::cpu
