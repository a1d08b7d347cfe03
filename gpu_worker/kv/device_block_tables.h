// DeviceBlockTables: one sequence's KV-store block tables, every layer, K and V of each KV head,
// mirrored in backend (device) memory, so that a GPU gathers the rows a step chose straight out
// of the store's arena (mapped here and registered with the backend) by slot and block id
// (Backend::GatherBlockRows): no address per row is made on the host, and the tables cross the
// link only when a layer's rows reach a new block (every block_bytes / row_bytes tokens: 256 for
// head_dim 128 in bf16 with the store's default 64 KiB blocks).
// The store answers them with a gather (kv_store/row_copy.h BlockTableOut): the blocks a layer
// gained since the last answer, after the appends queued before it, so they always cover the
// rows the gather's slots name.
//
// Layout, host and device alike: [layers, 2 (K, V), num_kv_heads, capacity] int32, allocated
// when the sequence opens for its capacity, so that decode steps allocate nothing. Not
// thread-safe: the host table and block counts are written by the store client's gather (on its
// thread) and read after its ticket is done.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "kv_store/row_copy.h"

namespace infinigen {

class DeviceBlockTables {
 public:
  DeviceBlockTables(int num_layers, int num_kv_heads, int64_t rows_per_block)
      : num_layers_(num_layers), num_kv_heads_(num_kv_heads), rows_per_block_(rows_per_block) {}

  // Blocks per KV head that `rows` rows of a layer take.
  int64_t BlocksFor(int64_t rows) const { return (rows + rows_per_block_ - 1) / rows_per_block_; }
  // Backend bytes (and as many host bytes) the tables of a sequence of `rows` rows a layer take.
  size_t BytesFor(int64_t rows) const {
    return BytesFor(num_layers_, num_kv_heads_, rows_per_block_, rows);
  }
  static size_t BytesFor(int num_layers, int num_kv_heads, int64_t rows_per_block, int64_t rows) {
    return static_cast<size_t>(num_layers) * 2 * num_kv_heads *
           static_cast<size_t>((rows + rows_per_block - 1) / rows_per_block) * sizeof(int32_t);
  }
  int64_t capacity() const { return capacity_; }
  // Blocks per KV head of `layer` the store has answered (and the tables hold).
  int64_t held_blocks(int layer) const {
    return current_ == nullptr ? 0 : std::min(current_->blocks[layer], capacity_);
  }
  bool on_device() const { return device_ != nullptr; }

  // Room for `rows` rows in every layer, on the device too: allocated now when the tables have
  // less (what the store answered so far is kept, and copied to the device again at the next
  // OnDevice), to twice the old room with `grow` (a sequence past its opened capacity). Gathers
  // answering into the old tables must be over or abandoned (those keep writing where they
  // did, harmlessly: the old tables live as long as this object); Out() then says where the
  // new ones are. A failure leaves the tables as they were.
  absl::Status Reserve(Backend& backend, int64_t rows, bool grow = false);
  // Frees the device copy (an idle sequence); Reserve makes it again.
  void Release();
  // Where a gather of `layer` has the store answer its blocks (BlockTableOut), from the first
  // block not held yet.
  BlockTableOut Out(int layer);
  // `layer`'s K tables in backend memory ([num_kv_heads, capacity()]; its V tables follow),
  // copied there first if the store answered blocks since (an enqueued copy: no wait). Blocks
  // past the capacity are not there: a slot in one is gathered as a row of zeros and counted
  // as an error (BlockRowsGather), which a caller that reserves room for the rows it gathers
  // never sees. FAILED_PRECONDITION after Release.
  absl::StatusOr<const int32_t*> OnDevice(Backend& backend, int layer);

 private:
  size_t LayerEntries() const { return static_cast<size_t>(2 * num_kv_heads_ * capacity_); }

  const int num_layers_, num_kv_heads_;
  const int64_t rows_per_block_;
  int64_t capacity_ = 0;  // blocks per KV head each layer's tables have room for
  // The store's answers: tables [layers, 2, num_kv_heads, capacity] and, per layer, the blocks
  // per head it holds (which may pass the capacity: then only the capacity's are in the tables).
  struct Generation {
    std::vector<int32_t> host;
    std::vector<int64_t> blocks;
  };
  std::unique_ptr<Generation> current_;
  std::vector<std::unique_ptr<Generation>> retired_;  // before a growth (late answers land there)
  std::vector<int64_t> copied_;     // per layer: blocks of current_ that are in device_
  std::unique_ptr<Buffer> device_;  // [layers, 2, num_kv_heads, capacity]
};

}  // namespace infinigen
