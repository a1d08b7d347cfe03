#include "kernels/cpu/q6_k.h"

namespace infinigen::cpu {
namespace {

// Element c of row r: its block's index, its place in the block, and its group in the pair.
struct Place {
  int64_t at, o, group;
};

Place PlaceOf(const Q6_KMatrix& w, int64_t r, int64_t c) {
  const int64_t at = r * (w.cols / kQ6Block) + c / kQ6Block, o = c % kQ6Block;
  return {at, o, at % 2 + 2 * (o / 16)};
}

}  // namespace

int Q6_KValue(const Q6_KMatrix& w, int64_t r, int64_t c) {
  const Place p = PlaceOf(w, r, c);
  const uint8_t byte = w.ql[16 * p.at + p.o % 16];
  const int low = p.o < 16 ? byte & 0x0f : byte >> 4;
  const int high = (w.qh[16 * (p.at / 2) + p.o % 16] >> (2 * p.group)) & 3;
  return low | (high << 4);
}

float Q6_KScale(const Q6_KMatrix& w, int64_t r, int64_t c) {
  const Place p = PlaceOf(w, r, c);
  return w.d[p.at / 8] * static_cast<float>(w.s[4 * (p.at / 2) + p.group]);
}

void WidenQ6_KRow(const Q6_KMatrix& w, int64_t r, float* out) {
  for (int64_t c = 0; c < w.cols; ++c) {
    out[c] = Q6_KScale(w, r, c) * static_cast<float>(Q6_KValue(w, r, c) - 32);
  }
}

void EmbeddingQ6_K(const Q6_KMatrix& table, const int32_t* ids, int64_t n, float* out,
                   int64_t out_stride) {
  for (int64_t i = 0; i < n; ++i) WidenQ6_KRow(table, ids[i], out + i * out_stride);
}

}  // namespace infinigen::cpu
