// KvCache: where a sequence's K/V rows live between steps. The model appends the K/V of every
// token it processes and reads them back for attention. BackendKvCache keeps them in backend
// memory; the KV store service implements the same seam with host RAM on another process.
//
// Rows of one layer are "slots". Without a memory limit a token's slot is its position. A cache
// with a limit (the KV pool of INFINIGEN.md) overwrites evicted slots, so after eviction a slot
// holds whichever token was written there last, and the slot of a token may differ per KV head.
// Attention does not care: K is stored after RoPE, so rows can be attended in any order.
#pragma once

#include <cstdint>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"

namespace infinigen {

using SequenceId = uint64_t;

// The K/V layout of a model: what every cache of it stores per token.
struct KvCacheShape {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;

  size_t BytesPerToken() const {
    return static_cast<size_t>(2) * num_layers * num_kv_heads * head_dim * DTypeSize(dtype);
  }
  // K or V of one layer stored head-major at `data`: [num_kv_heads, rows_per_head, head_dim].
  KvView HeadMajor(void* data, int64_t rows_per_head) const {
    return {data, dtype, rows_per_head * head_dim, head_dim};
  }
};

// Bytes a sequence's decode steps read from a cache that is not resident, and what reading every
// stored row would have cost (the "KV bytes fetched vs a full fetch" of a request's usage).
struct FetchCounters {
  int64_t bytes_fetched = 0;
  int64_t bytes_full = 0;
  // Rows a prefetch found on the device already (StoreKvCacheOptions::reuse_rows): read, but not
  // moved, and not in bytes_fetched.
  int64_t bytes_reused = 0;
  int64_t fetches = 0;
  double wait_seconds = 0;  // time steps waited for prefetched rows
  int64_t evictions = 0;    // tokens a KV pool evicted to make room for later ones
};

struct KvLayerView {
  KvView k;
  KvView v;
  int64_t num_slots = 0;  // valid rows per KV head
};

// What every cache does: sequences open and close, and every token's K/V is appended at every
// layer. How a decode step then reads rows is what distinguishes the two kinds below; a decode
// step is built for one kind (gpu_worker/engine/decode_step.h) and never asks which it has.
class KvCache {
 public:
  virtual ~KvCache() = default;

  // Starts `seq` with room for `capacity_tokens` (a hint: appending past it may allocate).
  // ALREADY_EXISTS if open; RESOURCE_EXHAUSTED when the cache is full.
  virtual absl::Status Open(SequenceId seq, int64_t capacity_tokens) = 0;
  // Frees `seq`; unknown ids are ignored.
  virtual void Close(SequenceId seq) = 0;
  // Lets `seq` go here but keeps its stored KV, unowned, for another worker to take over (its
  // request failed in a way the router continues elsewhere); caches without a shared home just
  // close it.
  virtual void Release(SequenceId seq) { Close(seq); }
  // `seq` stays open but no step reads it until it is attached or closed (a kept conversation,
  // a prompt its samples fork from): a cache may free what it holds in backend memory for it.
  virtual void Idle(SequenceId seq) {}
  // Backend memory a sequence opened here with `capacity_tokens` holds until it is closed or
  // idle, at most (what admission reserves for it); 0 where the cache does not say. Depends on
  // the cache's shape and options only: callable from any thread.
  virtual size_t BackendBytesFor(int64_t capacity_tokens) const { return 0; }
  // Backend memory kept for reuse by sequences not opened yet (ended sequences' buffers), which
  // admission counts as held; ReleaseSpares frees it when a new sequence needs the room.
  virtual size_t SpareBackendBytes() const { return 0; }
  // Host memory a sequence opened here with `capacity_tokens` holds besides the backend's (slot
  // lists, row tables, bounce buffers), at most; 0 where the cache does not say. As
  // BackendBytesFor: callable from any thread.
  virtual size_t HostBytesFor(int64_t capacity_tokens) const { return 0; }
  virtual void ReleaseSpares() {}
  // Tokens stored for `seq` in every layer.
  virtual absl::StatusOr<int64_t> Length(SequenceId seq) const = 0;

  // Stores K and V of tokens [start, start + k.rows) at `layer`; k, v: [n, num_kv_heads *
  // head_dim] in backend memory. start may not pass the layer's length (no holes); rows at and
  // after `start` are replaced, so a sequence can be rolled back by appending at an earlier
  // position. `slots_out` (host, [n, num_kv_heads], may be null) receives each row's slot.
  virtual absl::Status Append(SequenceId seq, int layer, int64_t start, MatView k, MatView v,
                              int32_t* slots_out = nullptr) = 0;
  // One sequence's tokens in AppendLayer.
  struct LayerAppend {
    SequenceId seq = 0;
    int64_t start = 0;
    MatView k, v;
    int32_t* slots_out = nullptr;
  };
  // The appends of several sequences (each at most once) at one `layer` (a step's batch):
  // statuses[i] is what Append(items[i]...) would return, and an item refused (an unknown
  // sequence, out of order) does not stop the others. Caches whose rows leave backend memory
  // copy the batch's rows out together (one wait for the device per layer, not one per
  // sequence), so a failure of that copy fails every item of the layer; the default appends them
  // one by one.
  virtual void AppendLayer(int layer, std::span<const LayerAppend> items,
                           std::span<absl::Status> statuses) {
    for (size_t i = 0; i < items.size(); ++i) {
      const LayerAppend& a = items[i];
      statuses[i] = Append(a.seq, layer, a.start, a.k, a.v, a.slots_out);
    }
  }
  // AppendLayer in two halves around a wait for the backend that the caller makes anyway:
  // BeginAppendLayer places the items (statuses, slots_out, NumSlots as after the appends) and
  // starts moving their rows out of backend memory without waiting (Backend::CopyToHostLater);
  // EndAppendLayer hands them on, after waiting itself if the backend has not waited since. No
  // other append and no read of `layer` between the two. By default Begin is AppendLayer.
  virtual void BeginAppendLayer(int layer, std::span<const LayerAppend> items,
                                std::span<absl::Status> statuses) {
    AppendLayer(layer, items, statuses);
  }
  virtual void EndAppendLayer() {}
  // Valid slots of `layer` (after the appends so far).
  virtual absl::StatusOr<int64_t> NumSlots(SequenceId seq, int layer) = 0;
  // A decode step at `layer` read these slots (host, [num_kv_heads, count]; null: every stored
  // row, count per head). Caches that evict keep fetch counts and recency from it; caches that
  // read in place count the bytes read; others ignore it.
  virtual void RecordFetch(SequenceId seq, int layer, const int32_t* slots, int64_t count) {}
  // What `seq` has read so far (zeros for resident caches and unknown sequences).
  virtual FetchCounters Counters(SequenceId seq) const { return {}; }

  // Where other workers can find `seq` (its id in a shared KV store), 0 when it lives only here.
  virtual uint64_t Home(SequenceId seq) const { return 0; }
  // Starts `seq` from the rows another worker stored at `home` (that worker's Home), taking
  // them over: the continuation of a stream whose worker died or froze, without recomputing
  // them. Returns the tokens kept (every layer holds them; at most `max_length`), with room for
  // `capacity_tokens` in all (as Open). NOT_FOUND when they are gone; UNIMPLEMENTED for caches
  // that are not shared between workers.
  virtual absl::StatusOr<int64_t> Attach(SequenceId seq, uint64_t home, int64_t max_length,
                                         int64_t capacity_tokens) {
    return absl::UnimplementedError("this KV cache is not shared between workers");
  }
  // Opens `seq` (room for `capacity_tokens`, as Open) holding a copy of the first `length`
  // tokens of `parent` (an open sequence, which stays as it is): the samples of one prompt share
  // its prefill. Returns the tokens copied (at most what every layer of `parent` holds).
  // UNIMPLEMENTED for caches that cannot copy rows; the caller then computes them.
  virtual absl::StatusOr<int64_t> Fork(SequenceId seq, SequenceId parent, int64_t length,
                                       int64_t capacity_tokens) {
    return absl::UnimplementedError("this KV cache does not copy sequences");
  }
  // Whether a new sequence of `tokens` tokens fits in what the cache has free now (the KV
  // store's arena, counted in its allocation blocks); UNIMPLEMENTED where unknown.
  virtual absl::StatusOr<bool> HasRoomFor(int64_t tokens) {
    return absl::UnimplementedError("this KV cache does not report its free memory");
  }
};

// A cache whose rows the backend reads where they lie (backend memory): attention reads them in
// place, by index, and policies that score stored keys themselves (H2O, oracle) can see them.
class ResidentKvCache : public KvCache {
 public:
  // The valid slots of `layer`, readable by the backend until the next Append or Close.
  virtual absl::StatusOr<KvLayerView> Read(SequenceId seq, int layer) = 0;
  absl::StatusOr<int64_t> NumSlots(SequenceId seq, int layer) override {
    auto kv = Read(seq, layer);
    if (!kv.ok()) return kv.status();
    return kv->num_slots;
  }
};

// A cache whose rows live elsewhere (the KV store service, host RAM of another process or node):
// a decode step plans which rows it will read, starts moving them while the layer before
// computes (Prefetch, batched between BeginPrefetches and SubmitPrefetches), and collects them
// at the layer (Fetch). Only the planned rows move.
class StreamedKvCache : public KvCache {
 public:
  // Every stored row of `layer`, packed [num_kv_heads, rows, head_dim] in backend memory (a
  // prefill chunk's causal attention); waits for it. Valid until the next read of `seq`.
  virtual absl::StatusOr<KvLayerView> ReadAll(SequenceId seq, int layer) = 0;
  // Starts reading `count` slots per KV head of `layer` (host, [num_kv_heads, count], each
  // head's list in the order attention will see them). At most one prefetch per sequence and
  // layer parity is outstanding; Fetch() returns it. `extra_rows` more rows per head are left
  // free after the packed rows (rows num_kv_heads * count + ...) for the caller to fill.
  // `placed`: the caller finds the rows through Placement(), so the cache may answer them where
  // it keeps them rather than packed.
  virtual absl::Status Prefetch(SequenceId seq, int layer, const int32_t* slots, int64_t count,
                                int64_t extra_rows = 0, bool placed = false) = 0;
  // Where Fetch will answer the rows of the last Prefetch of (seq, layer) if not packed (a
  // prefetch made `placed`, of rows a cache keeps between steps: StoreKvCacheOptions::
  // reuse_rows): head g's j-th listed slot at row rows[g * count + j] of head g, heads
  // rows_per_head rows apart (the views' head_stride), and the extra rows after every head's
  // (rows num_kv_heads * rows_per_head + ...). rows null: packed (row j; rows_per_head = count).
  // Valid until the next Prefetch or Close of `seq`.
  struct RowPlacement {
    const int32_t* rows = nullptr;
    int64_t rows_per_head = 0;
  };
  virtual RowPlacement Placement(SequenceId seq, int layer) const { return {}; }
  // Prefetches made between these two calls may travel together (a batch's sequences in one
  // request to the store). Fetch submits any still held.
  virtual void BeginPrefetches() {}
  virtual void SubmitPrefetches() {}
  // The rows of the last Prefetch of `seq` at `layer`, packed: row j of KV head g is the j-th
  // slot of g's list. Valid until the next Prefetch or Close of `seq`. A cache whose rows the
  // backend can read where they lie answers row tables (KvView::rows) instead of copies; the
  // caller then fills the extra rows by setting their table entries to its rows' addresses.
  virtual absl::StatusOr<KvLayerView> Fetch(SequenceId seq, int layer) = 0;
  // Whether Prefetch answers the rows' addresses rather than copies of them (Fetch's row
  // tables): then prefetching every stored row costs next to nothing, and a decode step need
  // not guess the selection before the layer.
  virtual bool addresses_only() const { return false; }

  // Rows planned where the choice of them lies (a GPU's memory; Backend::PlanKeptRows): a
  // decode step that never reads its choices on the host. Whether `seq`'s `layer` is planned so
  // for lists of up to `max_list` slots a head (the other layers take Prefetch and Fetch).
  virtual bool PlansOnDevice(SequenceId seq, int layer, int64_t max_list) const { return false; }
  // Starts moving `list` (slots and count in backend memory, or every slot) of `layer` into the
  // rows the sequence keeps for it: only the slots not kept from before cross the link, queued
  // on the backend's side queue. Nothing waits.
  virtual absl::Status PrefetchOnDevice(SequenceId seq, int layer, const DeviceSlotList& list) {
    return absl::UnimplementedError("this KV cache plans no rows on the device");
  }
  // The rows of `choice` (in backend memory, current_slot the decode token's own) as attention
  // reads them: `kv`'s rows, listed per head by `indices` (backend memory, [num_kv_heads,
  // choice.capacity]; the current token at the row after every head's, kv_heads * (head_stride /
  // row_stride) + g, for the caller to write); choices not kept are gathered into rows of their
  // own first. Valid until the next call for (seq, layer).
  struct DeviceRows {
    KvLayerView kv;
    const int32_t* indices = nullptr;
  };
  virtual absl::StatusOr<DeviceRows> FetchOnDevice(SequenceId seq, int layer,
                                                   const DeviceSlotList& choice,
                                                   int64_t current_slot) {
    return absl::UnimplementedError("this KV cache plans no rows on the device");
  }
  // The step's plans' counts (rows moved, misses, errors) start their copy to the host, done at
  // the backend's next wait (the step's logits); SettleOnDevice(seq) then counts them and says
  // whether every plan of `seq` fit (INTERNAL when not: its attention read a wrong row, and its
  // appends held since BeginAppendStep are dropped, its length back where the step found it).
  virtual absl::Status QueueDeviceCounts() { return absl::OkStatus(); }
  virtual absl::Status SettleOnDevice(SequenceId seq) { return absl::OkStatus(); }
  // Orders the backend's own queue after the device prefetches of `layer` (every layer's where
  // layer < 0) queued so far, so that what they read (the lists PrefetchOnDevice was given) may
  // be written again. Nothing waits on the host; a no-op where they are ordered already.
  virtual absl::Status JoinDevicePrefetches(int layer) { return absl::OkStatus(); }
  // The appends of several layers (a decode step's, of at most `tokens` tokens, its prompt
  // chunks' included: they read what was stored before them with ReadStored) held from
  // BeginAppendLayer until one EndAppendLayer: one wait a step, not a layer. `decodes`: the
  // sequences whose decode tokens the step plans on the device (PrefetchOnDevice,
  // FetchOnDevice), which the cache may prepare together. false where the cache cannot (then
  // each layer's Begin needs its End).
  virtual bool BeginAppendStep(int64_t tokens, std::span<const SequenceId> decodes) {
    return false;
  }
  // A prompt chunk's read beside held appends: rows [0, rows) of `layer` as the store holds
  // them (not those appended since BeginAppendStep), head-major with `room` rows free after each
  // head's (KvCacheShape::HeadMajor of rows + room), which the caller fills with the chunk's own
  // K/V. ReadsStored: whether `seq`'s rows can be read so (false: its appends must reach the
  // store first, and ReadAll read them).
  virtual bool ReadsStored(SequenceId seq) const { return false; }
  // Starts ReadStored's read of `layer` (during the layer before; ReadStored with the same rows
  // and room then finishes it). Between BeginPrefetches and SubmitPrefetches it travels with
  // the batch's prefetches.
  virtual absl::Status PrefetchStored(SequenceId seq, int layer, int64_t rows, int64_t room) {
    return absl::UnimplementedError("this KV cache holds no appends");
  }
  virtual absl::StatusOr<KvLayerView> ReadStored(SequenceId seq, int layer, int64_t rows,
                                                 int64_t room) {
    return absl::UnimplementedError("this KV cache holds no appends");
  }
};

}  // namespace infinigen
