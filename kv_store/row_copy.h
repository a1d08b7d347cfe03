// One KV head's selected rows out of the arena's blocks: copied into packed K and V buffers (the
// inner loop of every gather that copies: the store's Gather, and the shm client reading a
// mapped arena), or their addresses answered for a gather in place. Rows are random and
// latency-bound, so the loop prefetches rows ahead of the copy; consecutive slots within a block
// are one copy.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinigen {

// Where one KV head's rows of one layer live. Slot s is row s % rows_per_block of block
// blocks[s / rows_per_block]; block b starts at arena + b * block_bytes.
struct HeadRowsView {
  const uint8_t* arena = nullptr;
  size_t block_bytes = 0;
  const int32_t* k_blocks = nullptr;
  const int32_t* v_blocks = nullptr;
  int64_t row_bytes = 0;
  int64_t rows_per_block = 0;
};

// Copies rows slots[0..count) of K and V to k_out and v_out ([count, row_bytes] each). The
// slots must be valid (callers check them first).
void CopyHeadRows(const HeadRowsView& head, const int32_t* slots, int64_t count, uint8_t* k_out,
                  uint8_t* v_out);

// Writes the addresses of rows slots[0..count) of K and V to k_rows and v_rows ([count] each).
void HeadRowAddresses(const HeadRowsView& head, const int32_t* slots, int64_t count,
                      const void** k_rows, const void** v_rows);

}  // namespace infinigen
