// ReusedRows: which K/V rows of one sequence a device keeps between decode steps, so that a
// prefetch moves over the host link only the rows it did not move before (#22 item 8; the hot
// buffer of the 2026 serving systems, beyond the InfiniGen paper). Consecutive decode steps
// choose largely the same rows of a layer: each (layer, KV head) keeps the rows of its last
// prefetch, `rows` of them at most, in a device buffer of that many rows. A new prefetch's list
// finds there the rows it shares with the last one (hits), and the rows of the last one it does
// not list are free for its others (misses), which the caller gathers into them. The host keeps
// the bookkeeping (slot -> row); the caller keeps the buffers and moves the rows.
//
// Rows are kept by slot: valid while a slot keeps its token (the KV store appends in order and
// never rewrites a row; a KV pool, which reuses slots, does not use this).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace infinigen {

class ReusedRows {
 public:
  // A sequence with `num_layers` layers of `num_kv_heads` heads, `rows` rows kept per (layer,
  // KV head). Sizes everything here: Place allocates nothing.
  ReusedRows(int num_layers, int num_kv_heads, int64_t rows);

  int64_t rows() const { return rows_; }

  // What Place decided for one list: where each listed slot's row is (or goes) in the layer's
  // buffer, and the rows to move. Laid out for one copy to a device: the misses' slots
  // [num_kv_heads, count] (head g's first miss_counts[g] at g * count), then their rows in the
  // buffer (same layout), then miss_counts [num_kv_heads].
  struct Plan {
    std::vector<int32_t> positions;  // [num_kv_heads, count]: row of head g's j-th slot
    std::vector<int32_t> moves;      // miss slots, miss rows, miss counts (above)
    int64_t count = 0;
    int64_t misses = 0;       // rows to move, all heads
    int64_t most_misses = 0;  // of one head
    const int32_t* miss_slots() const { return moves.data(); }
    const int32_t* miss_rows(int num_kv_heads) const { return moves.data() + num_kv_heads * count; }
    const int32_t* miss_counts(int num_kv_heads) const {
      return moves.data() + 2 * num_kv_heads * count;
    }
  };
  // Plans a read of `count` slots per KV head of `layer` (host, [num_kv_heads, count], each
  // head's list strictly ascending) and takes it as what the layer's buffer holds from now on.
  // false, and nothing changed, when the list does not fit (count > rows) or a head's list is
  // not strictly ascending from 0 or more. `plan` keeps its capacity between calls.
  bool Place(int layer, const int32_t* slots, int64_t count, Plan& plan);
  // The layer's rows are unknown (a move planned for them did not happen): the next Place of it
  // moves every row it lists.
  void Forget(int layer);
  void ForgetAll();

  // Host bytes a ReusedRows of this shape holds, and a Plan of it.
  static size_t BytesFor(int num_layers, int num_kv_heads, int64_t rows);
  static size_t PlanBytesFor(int num_kv_heads, int64_t rows);

 private:
  struct Head {
    // The rows held: slots ascending, each with its row in the buffer; the rows held by nobody.
    std::vector<int32_t> slots, rows, free;
  };
  Head& At(int layer, int g) { return heads_[static_cast<size_t>(layer) * num_kv_heads_ + g]; }

  int num_layers_, num_kv_heads_;
  int64_t rows_;
  std::vector<Head> heads_;
  std::vector<int32_t> next_slots_, next_rows_;  // Place's scratch
};

}  // namespace infinigen
