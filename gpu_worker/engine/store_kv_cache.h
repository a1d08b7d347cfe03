// StoreKvCache: the KvCache of a worker whose K/V live in the KV store service (host RAM,
// possibly another process or node). Appends are write-behind through the store client's
// ordered queue; a decode step that selects rows prefetches exactly those rows into a staging
// buffer and attends over them (Prefetch/Fetch), so the bytes moved per step are the selection,
// not the sequence. Dense reads (prefill chunks after the first, the `full` policy) gather every
// row: the FlexGen-style full fetch.
//
// Not thread-safe: the engine thread owns it. The store client it uses may be shared.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "gpu_worker/engine/kv_cache.h"
#include "kv_store/client/kv_store_client.h"

namespace infinigen {

struct StoreKvCacheOptions {
  // Store sequence ids are id_base + the engine's sequence id, so that workers sharing a store
  // never collide (the worker draws id_base at random).
  uint64_t id_base = 0;
  std::string owner = "worker";                     // lease holder name in the store
  absl::Duration fetch_timeout = absl::Seconds(5);  // a gather that takes longer fails the step
};

class StoreKvCache final : public KvCache {
 public:
  StoreKvCache(Backend& backend, const KvCacheShape& shape, KvStoreClient& client,
               const StoreKvCacheOptions& options);
  ~StoreKvCache() override;

  absl::Status Open(SequenceId seq, int64_t capacity_tokens) override;
  void Close(SequenceId seq) override;
  absl::StatusOr<int64_t> Length(SequenceId seq) const override;
  absl::Status Append(SequenceId seq, int layer, int64_t start, MatView k, MatView v,
                      int32_t* slots_out = nullptr) override;
  absl::StatusOr<KvLayerView> Read(SequenceId seq, int layer) override;

  bool resident() const override { return false; }
  absl::StatusOr<int64_t> NumSlots(SequenceId seq, int layer) override;
  absl::Status Prefetch(SequenceId seq, int layer, const int32_t* slots, int64_t count,
                        int64_t extra_rows = 0) override;
  absl::StatusOr<KvLayerView> Fetch(SequenceId seq, int layer) override;

  FetchCounters Counters(SequenceId seq) const override;
  uint64_t StoreId(SequenceId seq) const { return options_.id_base + seq; }

 private:
  struct Staging {
    std::unique_ptr<Buffer> k, v;         // backend memory
    std::vector<uint8_t> host_k, host_v;  // host bounce buffers (backends without host access)
    size_t capacity = 0;                  // bytes of each
  };
  // A gather in flight or done: one per layer parity, so that the next layer's rows can move
  // while this layer's are being used.
  struct Pending {
    Staging staging;
    std::unique_ptr<GatherTicket> ticket;
    int layer = -1;
    int64_t count = 0;
  };
  struct Sequence {
    std::vector<int64_t> length;  // per layer
    Pending pending[2];
    FetchCounters counters;
  };

  absl::StatusOr<Sequence*> Find(SequenceId seq);
  absl::Status EnsureStaging(Staging& s, size_t bytes);
  // Gathers `count` slots per head into the sequence's staging and waits.
  absl::Status StartGather(SequenceId seq, Sequence& s, int layer, std::vector<int32_t> slots,
                           int64_t count, int64_t extra_rows = 0);
  absl::StatusOr<KvLayerView> FinishGather(Sequence& s, int layer);
  // Ends an outstanding gather (waits for it so its buffers can be reused or freed).
  static void DropTicket(Pending& p);
  size_t RowBytes() const;
  // Copies the rows of `m` (backend memory, possibly strided) packed to host memory `out`.
  absl::Status RowsToHost(MatView m, uint8_t* out);

  Backend& backend_;
  KvCacheShape shape_;
  KvStoreClient& client_;
  StoreKvCacheOptions options_;
  bool host_access_;  // the backend's memory is host memory (CPU): gather straight into it
  absl::flat_hash_map<SequenceId, Sequence> sequences_;
  std::unique_ptr<Buffer> pack_;  // RowsToHost's packed rows on backends without host access
};

}  // namespace infinigen
