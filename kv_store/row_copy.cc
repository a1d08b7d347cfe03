#include "kv_store/row_copy.h"

#include <algorithm>
#include <cstring>

namespace infinigen {
namespace {

// Rows requested this many positions ahead of the copy (2 to 64 measure the same).
constexpr int64_t kAhead = 8;

// One row of a size known at compile time, as unaligned 32-byte moves: std::memcpy of a constant
// 512 bytes compiles to `rep movsq`, whose start-up cost made 512-byte rows 1.4x slower than a
// call to memcpy.
template <int64_t kBytes>
inline void CopyRow(uint8_t* dst, const uint8_t* src) {
  static_assert(kBytes % 32 == 0);
  typedef uint8_t Chunk __attribute__((vector_size(32), aligned(1), may_alias));
#pragma GCC unroll 16
  for (int64_t i = 0; i < kBytes; i += 32) {
    *reinterpret_cast<Chunk*>(dst + i) = *reinterpret_cast<const Chunk*>(src + i);
  }
}

// kRowBytes > 0 fixes the row size at compile time: one row's copy is then a few inline vector
// moves instead of a call. shift >= 0 says rows_per_block == 1 << shift, so a slot's block and
// row come from a shift and a mask instead of two divisions.
template <int64_t kRowBytes>
void CopyRowsOf(const HeadRowsView& h, int shift, const int32_t* slots, int64_t count,
                uint8_t* k_out, uint8_t* v_out) {
  const int64_t row_bytes = kRowBytes > 0 ? kRowBytes : h.row_bytes;
  const int64_t per_block = h.rows_per_block;
  const int64_t mask = per_block - 1;
  auto block_of = [&](int64_t slot) { return shift >= 0 ? slot >> shift : slot / per_block; };
  auto row_in_block = [&](int64_t slot) { return shift >= 0 ? slot & mask : slot % per_block; };
  auto offset = [&](const int32_t* blocks, int64_t slot) {
    return static_cast<size_t>(blocks[block_of(slot)]) * h.block_bytes +
           static_cast<size_t>(row_in_block(slot) * row_bytes);
  };
  for (int64_t j = 0; j < count;) {
    if (j + kAhead < count) {
      const int64_t ahead = slots[j + kAhead];
      const uint8_t* pk = h.arena + offset(h.k_blocks, ahead);
      const uint8_t* pv = h.arena + offset(h.v_blocks, ahead);
      for (int64_t line = 0; line < row_bytes; line += 64) {
        __builtin_prefetch(pk + line);
        __builtin_prefetch(pv + line);
      }
    }
    const int64_t first = slots[j];
    const uint8_t* k = h.arena + offset(h.k_blocks, first);
    const uint8_t* v = h.arena + offset(h.v_blocks, first);
    const int64_t left_in_block = per_block - row_in_block(first);
    if (left_in_block == 1 || j + 1 == count || slots[j + 1] != first + 1) {
      if constexpr (kRowBytes > 0) {  // the usual case: one random row
        CopyRow<kRowBytes>(k_out + j * row_bytes, k);
        CopyRow<kRowBytes>(v_out + j * row_bytes, v);
      } else {
        std::memcpy(k_out + j * row_bytes, k, row_bytes);
        std::memcpy(v_out + j * row_bytes, v, row_bytes);
      }
      ++j;
      continue;
    }
    int64_t run = 2;
    while (run < left_in_block && j + run < count && slots[j + run] == first + run) ++run;
    std::memcpy(k_out + j * row_bytes, k, run * row_bytes);
    std::memcpy(v_out + j * row_bytes, v, run * row_bytes);
    j += run;
  }
}

// rows_per_block as a shift when it is a power of two, else -1.
int ShiftOf(int64_t rows_per_block) {
  if (rows_per_block > 0 && (rows_per_block & (rows_per_block - 1)) == 0) {
    return __builtin_ctzll(rows_per_block);
  }
  return -1;
}

}  // namespace

void HeadRowAddresses(const HeadRowsView& h, const int32_t* slots, int64_t count,
                      const void** k_rows, const void** v_rows) {
  const int shift = ShiftOf(h.rows_per_block);
  const int64_t mask = h.rows_per_block - 1;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t slot = slots[j];
    const int64_t block = shift >= 0 ? slot >> shift : slot / h.rows_per_block;
    const size_t row =
        static_cast<size_t>((shift >= 0 ? slot & mask : slot % h.rows_per_block) * h.row_bytes);
    k_rows[j] = h.arena + static_cast<size_t>(h.k_blocks[block]) * h.block_bytes + row;
    v_rows[j] = h.arena + static_cast<size_t>(h.v_blocks[block]) * h.block_bytes + row;
  }
}

void CopyHeadRows(const HeadRowsView& head, const int32_t* slots, int64_t count, uint8_t* k_out,
                  uint8_t* v_out) {
  const int shift = ShiftOf(head.rows_per_block);
  switch (head.row_bytes) {  // head_dim 64 / 128 / 256 in 16-bit, 64 / 128 in float32
    case 128:
      return CopyRowsOf<128>(head, shift, slots, count, k_out, v_out);
    case 256:
      return CopyRowsOf<256>(head, shift, slots, count, k_out, v_out);
    case 512:
      return CopyRowsOf<512>(head, shift, slots, count, k_out, v_out);
    default:
      return CopyRowsOf<0>(head, shift, slots, count, k_out, v_out);
  }
}

void AnswerHeadBlocks(const BlockTableOut& out, int num_kv_heads, int head, const int32_t* k_blocks,
                      const int32_t* v_blocks, int64_t n) {
  const int64_t end = std::min(n, out.capacity);
  if (out.known >= end) return;
  const size_t count = static_cast<size_t>(end - out.known);
  int32_t* k = out.table + static_cast<size_t>(head) * out.capacity + out.known;
  int32_t* v = out.table + static_cast<size_t>(num_kv_heads + head) * out.capacity + out.known;
  std::memcpy(k, k_blocks + out.known, count * sizeof(int32_t));
  std::memcpy(v, v_blocks + out.known, count * sizeof(int32_t));
}

}  // namespace infinigen
