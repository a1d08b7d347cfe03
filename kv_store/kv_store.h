// KvStore: the full K/V of every sequence in host memory, served by token index.
//
// Per sequence, per layer, per KV head, K and V rows live in fixed-size arena blocks (block_tokens
// rows each) found through a block table; rows are `slots` (positions, or with a capacity the
// KV pool's slots, see slot_table.h). Append stores rows in order; Gather copies the rows a
// decode step selected, packed, for any number of sequences at once, on several threads for
// large requests. Sequences belong to an owner whose lease must be renewed; ReapExpired frees
// the sequences of owners that stopped (a worker that died).
//
// Thread-safe: a store-wide mutex guards the sequence table and the arena; each sequence has its
// own lock, so gathers of different sequences and of the same sequence run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/thread_pool.h"
#include "kv_store/arena.h"
#include "kv_store/row_copy.h"
#include "kv_store/slot_table.h"

namespace infinigen {

using StoreSequenceId = uint64_t;

// What a served store keeps committed ahead of its blocks (KvStoreConfig::prefault_ahead_bytes):
// room for the blocks a batch starts at once (a new block in every layer and KV head, K and V:
// 32 MiB per sequence of Llama-3.1-8B with 64 KiB blocks).
inline constexpr size_t kServedPrefaultAheadBytes = size_t{128} << 20;

struct KvStoreConfig {
  size_t capacity_bytes = size_t{1} << 30;
  int64_t block_tokens = 64;     // rows per arena block
  int64_t max_row_bytes = 1024;  // the largest head_dim x dtype size accepted (sizes blocks)
  int gather_threads = 2;
  int64_t parallel_gather_bytes = 2 << 20;  // gathers at least this large use the thread pool
  absl::Duration lease = absl::Seconds(30);
  bool shared_memory = true;  // see ArenaOptions::shared
  std::string shm_path;       // see ArenaOptions
  bool huge_pages = true;
  // Arena bytes kept committed past the highest block handed out (ArenaOptions,
  // kv_store/arena_prefaulter.h); 0: none (pages fault in as rows are first written). The
  // service and the worker's in-process store use kServedPrefaultAheadBytes.
  size_t prefault_ahead_bytes = 0;

  absl::Status Validate() const;
};

struct SequenceSpec {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;
  int64_t capacity_tokens = 0;  // > 0: a KV pool of this many tokens per (layer, head)
  EvictionPolicy eviction = EvictionPolicy::kCounter;
  std::string owner;  // lease holder (a worker)

  int64_t row_bytes() const { return static_cast<int64_t>(head_dim) * DTypeSize(dtype); }
};

// One layer of one sequence to gather: `count` slots per KV head ([heads, count]), written
// packed to k_out and v_out as [heads, count, head_dim].
struct GatherItem {
  StoreSequenceId seq = 0;
  int layer = 0;
  int64_t count = 0;
  std::span<const int32_t> slots;  // [heads, count]
  uint8_t* k_out = nullptr;        // [heads, count, row]
  uint8_t* v_out = nullptr;
  // The KV heads gathered: [head_begin, head_begin + heads); heads < 0 means all of them. A
  // transport cuts a large gather into pieces of a few heads this way and streams them.
  int head_begin = 0;
  int heads = -1;
  // In place instead (callers in this process, which can read the arena): the address of each
  // row is written to k_rows / v_rows ([heads, count]) and nothing is copied; k_out and v_out
  // are unused. An address stays valid until the sequence is closed (or, in a KV pool, its
  // slot is given to another token).
  const void** k_rows = nullptr;
  const void** v_rows = nullptr;
  // When > 0: the row size k_out and v_out were sized for. A sequence closed and opened again
  // with other rows between the caller's sizing and the gather then fails (FAILED_PRECONDITION)
  // instead of overrunning them.
  int64_t row_bytes = 0;
  // By block table instead of rows or addresses (every KV head of the layer; see BlockTableOut).
  BlockTableOut block_table{};
  bool in_place() const {
    return (k_rows != nullptr && v_rows != nullptr) || block_table.requested();
  }
};

// True when `indices` slots are `count` rows for each of `heads` KV heads. Counts come from the
// network: no product that could overflow.
inline bool CountMatches(int64_t count, int64_t heads, size_t indices) {
  if (count < 0 || heads < 0) return false;
  if (heads == 0) return indices == 0;
  return indices % static_cast<uint64_t>(heads) == 0 &&
         static_cast<uint64_t>(count) == indices / static_cast<uint64_t>(heads);
}

// Where the rows of one layer live: block ids per KV head for K and V.
struct LayerBlocks {
  int64_t rows = 0;
  int64_t row_bytes = 0;
  std::vector<std::vector<int32_t>> k_blocks, v_blocks;  // [head][block]
};

struct KvStoreStats {
  int64_t sequences = 0;
  int64_t bytes_capacity = 0, bytes_used = 0;
  int64_t tokens_stored = 0;  // Σ over sequences of layer-0 rows
  int64_t appends = 0, gathers = 0, bytes_gathered = 0;
  int64_t evictions = 0, rejections = 0, leases_expired = 0;
  int64_t block_bytes = 0;  // the arena's allocation unit (per layer, KV head, K or V)
};

class KvStore {
 public:
  // Open refuses sequences with more (Llama 3.1 405B: 126 layers, 8 KV heads).
  static constexpr int kMaxLayers = 1024, kMaxKvHeads = 1024;
  static absl::StatusOr<std::unique_ptr<KvStore>> Create(const KvStoreConfig& config);

  // ALREADY_EXISTS if open; INVALID_ARGUMENT for a bad spec; RESOURCE_EXHAUSTED if a KV pool
  // capacity cannot be reserved.
  absl::Status Open(StoreSequenceId seq, const SequenceSpec& spec, absl::Time now);
  absl::Status Close(StoreSequenceId seq);
  // Hands sequence `from` to another owner under the id `to` (a worker continuing a stream whose
  // worker died or froze): every layer is cut to the tokens all layers hold, at most
  // `max_length` (a dead worker's last appends may have reached some layers only), the lease
  // passes to `spec.owner`, and `from` ceases to exist, so that appends and closes still sent
  // by the old owner find nothing (NOT_FOUND): the id is the ownership token. Returns the
  // tokens kept. NOT_FOUND when the store no longer has `from`; ALREADY_EXISTS for a `to` in
  // use; FAILED_PRECONDITION when `spec` (layers, KV heads, head_dim, dtype) is not the one it
  // was stored with, or for a KV pool sequence (its slots are not positions).
  absl::StatusOr<int64_t> Attach(StoreSequenceId from, StoreSequenceId to, const SequenceSpec& spec,
                                 int64_t max_length, absl::Time now);
  // A copy of the first `length` tokens of sequence `from` (at most what every layer holds) as
  // the new sequence `to`, owned by `spec.owner`; `from` stays as it was. The samples of one
  // prompt (a request with n > 1) share its prefill this way. Returns the tokens copied. Errors
  // as Attach's, and RESOURCE_EXHAUSTED (nothing changed) when the copy does not fit.
  absl::StatusOr<int64_t> Fork(StoreSequenceId from, StoreSequenceId to, const SequenceSpec& spec,
                               int64_t length, absl::Time now);
  // Stores rows [start, start + n) of `layer`: k and v are [n, num_kv_heads, head_dim] in the
  // sequence's dtype (`bytes` each). `slots_out` ([n, num_kv_heads], may be null) gets the slots.
  // Appends must be in order (start = the layer's length). RESOURCE_EXHAUSTED when the store is
  // full leaves every sequence (this one included) as it was. In a KV pool sequence `at_slots`
  // ([n, num_kv_heads], or empty) says which slot each row takes, the choice of a worker that
  // keeps the partial keys of the same slots (it mirrors the slot tables); each slot below the
  // capacity and at most one past the head's slots in use (INVALID_ARGUMENT otherwise, and for
  // slots given to a sequence without a capacity). Empty: the store evicts by `spec.eviction`.
  absl::Status Append(StoreSequenceId seq, int layer, int64_t start, int64_t n, const uint8_t* k,
                      const uint8_t* v, size_t bytes, int32_t* slots_out = nullptr,
                      std::span<const int32_t> at_slots = {});
  // Copies the items' rows. Validates everything before copying anything.
  // `pieces_left` > 0 says more pieces of the same client gather follow (a transport streaming
  // it): the gather is counted once, with its last piece.
  absl::Status Gather(std::span<const GatherItem> items, int pieces_left = 0);
  // Gives `seq` up without freeing it: it belongs to no owner from now on and lives until its
  // lease ends (`lease` from now), for another worker to Attach (a stream whose worker failed it
  // for want of its KV, which the router moves). NOT_FOUND when unknown.
  absl::Status Release(StoreSequenceId seq, absl::Time now);
  // Extends the lease of every sequence of `owner`; returns how many it holds.
  int64_t Renew(const std::string& owner, absl::Time now);
  // Frees sequences whose lease ended; returns how many.
  int64_t ReapExpired(absl::Time now);

  absl::StatusOr<int64_t> Length(StoreSequenceId seq, int layer) const;
  absl::StatusOr<SequenceSpec> Spec(StoreSequenceId seq) const;
  // The block table of one layer (for transports that copy rows themselves).
  absl::StatusOr<LayerBlocks> Blocks(StoreSequenceId seq, int layer) const;
  KvStoreStats Stats() const;
  const Arena& arena() const { return *arena_; }
  const KvStoreConfig& config() const { return config_; }

 private:
  struct HeadRows {
    std::vector<int32_t> k_blocks, v_blocks;
    SlotTable slots;  // used when the sequence has a capacity
  };
  struct Layer {
    int64_t length = 0;  // rows appended
    int64_t rows = 0;    // valid slots (== length without a capacity)
    std::vector<HeadRows> heads;
  };
  struct Sequence {
    SequenceSpec spec;
    absl::Time lease_end;
    int64_t step = 0;
    mutable absl::Mutex mu;
    std::vector<Layer> layers ABSL_GUARDED_BY(mu);
  };

  explicit KvStore(const KvStoreConfig& config) : config_(config) {}
  // Whether sequence `s` can be handed to or copied for a worker expecting `spec`.
  static absl::Status CheckTransferable(StoreSequenceId seq, const Sequence& s,
                                        const SequenceSpec& spec, absl::string_view verb);
  // The layer's rows once `at_slots` (Append) are stored; INVALID_ARGUMENT for a bad slot.
  static absl::StatusOr<int64_t> RowsAfter(const Layer& l, const SequenceSpec& spec, int64_t n,
                                           std::span<const int32_t> at_slots);
  std::shared_ptr<Sequence> Find(StoreSequenceId seq) const ABSL_LOCKS_EXCLUDED(mu_);
  uint8_t* Row(const std::vector<int32_t>& blocks, int64_t slot, int64_t row_bytes) const;
  void FreeSequence(Sequence& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes `seq` if it is still `s` and its lease ended by `lease_ended_by` (NOT_FOUND,
  // FAILED_PRECONDITION otherwise).
  absl::Status CloseIf(StoreSequenceId seq, const std::shared_ptr<Sequence>& s,
                       absl::Time lease_ended_by);

  KvStoreConfig config_;
  std::unique_ptr<ThreadPool> pool_;
  mutable absl::Mutex mu_;
  std::unique_ptr<Arena> arena_ ABSL_PT_GUARDED_BY(mu_);
  absl::flat_hash_map<StoreSequenceId, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  KvStoreStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace infinigen
