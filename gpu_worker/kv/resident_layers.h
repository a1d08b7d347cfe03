// ResidentLayers: a copy, in backend (device) memory, of the K/V of each sequence's first
// `layers` layers, beside their home in the KV store. InfiniGen's dense layers (the first two by
// default, INFINIGEN.md) read every stored row every step: over the store that is the largest
// part of what a step moves across the host link (Llama-3.1-8B at 32K tokens: 2 x 128 MiB per
// step against ~30 x 12 MiB for the sparse layers at a 10% budget), though they hold 2/32 of the
// K/V. Kept here, a dense read of them is one copy inside the device. The store still receives
// every row (it stays the sequence's home: another worker resumes from it).
//
// Layout per sequence: K and V each [layers, num_kv_heads, capacity, head_dim], allocated when
// the sequence opens for its capacity, so that decode steps allocate nothing. Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "gpu_worker/kv/kv_cache.h"

namespace infinigen {

class ResidentLayers {
 public:
  ResidentLayers(Backend& backend, const KvCacheShape& shape, int layers);

  int layers() const { return layers_; }
  // Backend bytes a sequence's copy takes per token of its capacity (admission).
  static size_t BytesPerToken(const KvCacheShape& shape, int layers);

  // Room for `capacity_tokens` tokens of `seq`, allocated now.
  absl::Status Open(SequenceId seq, int64_t capacity_tokens);
  void Close(SequenceId seq);
  // Whether rows [0, rows) of every head of `layer` are here for `seq`.
  bool Holds(SequenceId seq, int layer, int64_t rows) const;
  // Rows [start, start + k.rows) of `layer`, token-major [n, num_kv_heads * head_dim] in backend
  // memory (converted to the cache's dtype by Backend::Copy). An append out of order or past the
  // capacity is not kept: the layer holds the rows before it, and reads of more go to the store.
  absl::Status Append(SequenceId seq, int layer, int64_t start, MatView k, MatView v);
  // Rows [0, rows) of every head of `layer` into k_out / v_out (backend memory), head-major with
  // `rows_per_head` (>= rows) rows per head: the layout of KvCacheShape::HeadMajor.
  absl::Status Read(SequenceId seq, int layer, int64_t rows, void* k_out, void* v_out,
                    int64_t rows_per_head);

 private:
  struct Entry {
    std::unique_ptr<Buffer> k, v;
    int64_t capacity = 0;
    std::vector<int64_t> length;  // per layer; -1: dropped
  };
  // Head g of `layer` in `base` (K or V of one sequence) from row `row`, `rows` rows.
  MatView HeadRows(void* base, const Entry& e, int layer, int g, int64_t row, int64_t rows) const;

  Backend& backend_;
  KvCacheShape shape_;
  int layers_;
  absl::flat_hash_map<SequenceId, Entry> entries_;
};

}  // namespace infinigen
