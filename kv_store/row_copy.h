// One KV head's selected rows out of the arena's blocks: copied into packed K and V buffers (the
// inner loop of every gather that copies: the store's Gather, and the shm client reading a
// mapped arena), or their addresses answered for a gather in place, or the head's block ids
// answered for a gather by block table. Rows are random and
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

// A gather answered by block table (callers whose device reads the arena itself by block id,
// Backend::GatherBlockRows): the item's slots are checked as for any gather, but nothing is
// copied and no address is written. Instead the layer's block ids are written to `table`: K's of
// head g at table[g * capacity + i], V's at table[(num_kv_heads + g) * capacity + i], for the
// blocks i in [known, blocks) with i < capacity, and the layer's blocks per head go to *blocks.
// The caller keeps the blocks before `known` from earlier answers: a sequence's blocks never
// move while it is open (appends only add blocks). A *blocks above `capacity` tells the caller
// that its table is too small for what the store holds.
struct BlockTableOut {
  int32_t* table = nullptr;  // [2, num_kv_heads, capacity]
  int64_t capacity = 0;
  int64_t known = 0;
  int64_t* blocks = nullptr;
  bool requested() const { return table != nullptr && blocks != nullptr; }
};

// One KV head's part of a BlockTableOut answer: of its n K and V block ids, those from
// out.known up to out.capacity (the caller sets *out.blocks).
void AnswerHeadBlocks(const BlockTableOut& out, int num_kv_heads, int head, const int32_t* k_blocks,
                      const int32_t* v_blocks, int64_t n);

}  // namespace infinigen
