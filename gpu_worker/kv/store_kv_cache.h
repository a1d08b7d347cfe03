// StoreKvCache: the KvCache of a worker whose K/V live in the KV store service (host RAM,
// possibly another process or node). Appends are write-behind through the store client's
// ordered queue; a decode step that selects rows prefetches exactly those rows into a staging
// buffer and attends over them (Prefetch/Fetch), so the bytes moved per step are the selection,
// not the sequence. Dense reads (prefill chunks after the first, the `full` policy) gather every
// row: the FlexGen-style full fetch. When the store's memory is mapped here and the backend
// computes in host memory, a prefetch moves no bytes at all: it answers the rows' addresses and
// attention reads them in place (StoreKvCacheOptions::read_in_place). The prefetches of a
// batch's sequences for one layer travel as one gather (BeginPrefetches / SubmitPrefetches); if
// that gather fails, each sequence retries its own alone, so one bad sequence fails only itself.
//
// Not thread-safe: the engine thread owns it. The store client it uses may be shared.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "gpu_worker/kv/device_block_tables.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/kv_pool.h"
#include "gpu_worker/kv/resident_layers.h"
#include "gpu_worker/kv/row_reuse.h"
#include "kv_store/client/kv_store_client.h"

namespace infinigen {

struct StoreKvCacheOptions {
  // Store sequence ids are id_base + the engine's sequence id, so that workers sharing a store
  // never collide (the worker draws id_base at random).
  uint64_t id_base = 0;
  std::string owner = "worker";                     // lease holder name in the store
  absl::Duration fetch_timeout = absl::Seconds(5);  // a longer gather fails its sequence
  // Where the backend's memory is host memory and the client maps the store's (in-process, shm),
  // prefetched rows are attended where they lie (Fetch answers row tables, KvView::rows) instead
  // of being copied into staging. false: always copy (tests compare the two).
  bool read_in_place = true;
  // A batch's prefetches of a layer are sent together in gathers of up to this many bytes
  // (rows answered in place count nothing): few requests, while the first sequences' rows can
  // already be attended as the later ones move.
  size_t max_batched_gather_bytes = 1 << 20;
  // A GPU backend over a client that maps the store's memory (in-process, shm) registers that
  // memory with the backend and gathers a prefetch's rows with one kernel reading them over the
  // host link, instead of copying them on the CPU into staging and then to the device. The
  // kernel finds each row by slot in the sequence's block tables, which are kept on the device
  // (DeviceBlockTables, Backend::GatherBlockRows): the host copies the slot list, and the tables
  // when a layer reaches a new block, and makes no address per row. (The first form, rows by
  // host address through Backend::GatherRows, was 6.5x faster on an H200 than staging copies
  // for a full fetch at 8K tokens: docs/cuda.md.) Without registration (a transport that maps
  // nothing: grpc, ucx) prefetches copy.
  bool device_reads_mapped_rows = true;
  // A KV pool (INFINIGEN.md): each sequence keeps at most its share of tokens per (layer, KV
  // head) in the store, and a decode token past it evicts one of its own (counter, fifo, lru)
  // instead of growing. This cache chooses the slots (kv_pool.h) and sends them with the
  // appends, so that a policy's partial keys, kept by slot, stay aligned with the store's rows.
  // A prompt longer than its share is kept whole. Pooled sequences cannot be attached (their
  // slots are not positions): a stream whose worker fails is replayed.
  std::optional<KvPoolConfig> pool;
  // On a backend whose memory is not host memory (a GPU), the K/V of each sequence's first
  // `device_resident_layers` layers are also kept there (ResidentLayers; InfiniGen's dense
  // layers): a read of every stored row of those layers copies inside the device and moves no
  // bytes over the link. Only for sequences opened here (not attached or forked; no KV pool).
  int device_resident_layers = 0;
  // Row reuse (where the GPU gathers by block table, without a KV pool): each sequence keeps, for
  // every layer past the resident ones and each KV head, the rows of its last prefetch in a
  // device buffer of reuse_rows(capacity_tokens) rows (ReusedRows), so that a decode step's
  // prefetch moves over the host link only the rows the last one did not (misses), into rows
  // the last one held that this one does not list. The rest are read where they are
  // (FetchCounters::bytes_reused). A prefetch listing more rows (a dense read, a larger budget
  // than the function assumed) moves them all, as without reuse. Unset or 0: no reuse.
  std::function<int64_t(int64_t capacity_tokens)> reuse_rows;
  // With row reuse where the GPU gathers by block table: which rows a layer keeps is planned in
  // backend memory (Backend::PlanKeptRows) for the layers past the resident ones, so that a
  // decode step whose choices are made there (InfiniGen on a GPU) prefetches and maps them
  // without reading them on the host (PrefetchOnDevice, FetchOnDevice). Each layer's buffer
  // has kMissRows more rows per KV head for a choice's rows not kept; the host's prefetches of
  // such layers (prefill steps, host policies) move every row into staging instead of reusing.
  bool plan_on_device = false;
};

class StoreKvCache final : public StreamedKvCache {
 public:
  StoreKvCache(Backend& backend, const KvCacheShape& shape, KvStoreClient& client,
               const StoreKvCacheOptions& options);
  ~StoreKvCache() override;

  absl::Status Open(SequenceId seq, int64_t capacity_tokens) override;
  void Close(SequenceId seq) override;
  void Release(SequenceId seq) override;
  // Drops the sequence's device copy of its dense layers (ResidentLayers) and gives its staging
  // to the spares (an idle sequence is not read until it is attached, which sizes new staging).
  void Idle(SequenceId seq) override;
  // Its staging (both layers in flight, K and V, for every row at its capacity and the current
  // token's) where rows are copied, and its resident dense layers.
  size_t BackendBytesFor(int64_t capacity_tokens) const override;
  size_t SpareBackendBytes() const override { return spare_bytes_; }
  // Each of the two layers in flight: the gather's slot list, its row tables where rows are
  // read by address, and its K and V bounce buffers where a device's rows are copied.
  size_t HostBytesFor(int64_t capacity_tokens) const override;
  // Host memory the stagings of open sequences and spares hold: bounce buffers of a backend
  // without host access whose rows are copied (a transport that maps nothing: gRPC, UCX), as
  // large as the device staging; none where the GPU gathers by address or the backend is host.
  size_t HostStagingBytes() const;
  void ReleaseSpares() override;
  absl::StatusOr<int64_t> Length(SequenceId seq) const override;
  absl::Status Append(SequenceId seq, int layer, int64_t start, MatView k, MatView v,
                      int32_t* slots_out = nullptr) override;
  // Decode tokens of a device backend: every item's K and V packed there, one copy out.
  void AppendLayer(int layer, std::span<const LayerAppend> items,
                   std::span<absl::Status> statuses) override;
  void BeginAppendLayer(int layer, std::span<const LayerAppend> items,
                        std::span<absl::Status> statuses) override;
  void EndAppendLayer() override;
  absl::StatusOr<KvLayerView> ReadAll(SequenceId seq, int layer) override;
  uint64_t Home(SequenceId seq) const override {
    return sequences_.contains(seq) ? StoreId(seq) : 0;
  }
  // The store hands the sequence over under this cache's id for `seq` (KvStore::Attach): the
  // old id ceases to exist, fencing the worker that stored it.
  absl::StatusOr<int64_t> Attach(SequenceId seq, uint64_t home, int64_t max_length,
                                 int64_t capacity_tokens) override;
  // The store copies the rows (KvStore::Fork); nothing crosses the transport.
  absl::StatusOr<int64_t> Fork(SequenceId seq, SequenceId parent, int64_t length,
                               int64_t capacity_tokens) override;
  absl::StatusOr<bool> HasRoomFor(int64_t tokens) override;

  bool addresses_only() const override { return in_place_; }
  // Rows planned on the device (StoreKvCacheOptions::plan_on_device;
  // store_kv_cache_device_plan.cc; a prompt chunk's rows in such a step and the step's held
  // appends: store_kv_cache_stored_rows.cc).
  bool PlansOnDevice(SequenceId seq, int layer, int64_t max_list) const override;
  absl::Status PrefetchOnDevice(SequenceId seq, int layer, const DeviceSlotList& list) override;
  absl::StatusOr<DeviceRows> FetchOnDevice(SequenceId seq, int layer, const DeviceSlotList& choice,
                                           int64_t current_slot) override;
  absl::Status QueueDeviceCounts() override;
  absl::Status SettleOnDevice(SequenceId seq) override;
  absl::Status JoinDevicePrefetches(int layer) override;
  // The sequences of `decodes` are asked for together once the step needs the store's block
  // tables (TablesFor).
  bool BeginAppendStep(int64_t tokens, std::span<const SequenceId> decodes) override;
  bool ReadsStored(SequenceId seq) const override;
  absl::Status PrefetchStored(SequenceId seq, int layer, int64_t rows, int64_t room) override;
  absl::StatusOr<KvLayerView> ReadStored(SequenceId seq, int layer, int64_t rows,
                                         int64_t room) override;
  // Rows per KV head a device-planned layer has for a choice's rows not kept.
  static constexpr int64_t kMissRows = 64;
  // Backend memory the appends of a step planned on the device are held in (BeginAppendStep)
  // for steps of at most `tokens` tokens: every layer's K and V rows, and the room its growth
  // by half may add. Admission sets it aside (not per sequence: one step's, the cache's own).
  static size_t HeldAppendBytes(const KvCacheShape& shape, int64_t tokens);
  // Whether prefetches reach a GPU backend by Backend::GatherBlockRows from registered store
  // memory.
  bool device_gathers() const { return device_gathers_; }
  // Why the backend could not register the store's mapped arena at construction (OK if it did
  // or was not asked to): device gathers are then off.
  const absl::Status& registration_status() const { return registration_status_; }
  bool plans_on_device() const { return device_plans_; }
  // Store calls waited for to learn the block tables of rows planned on the device (at most
  // one a step, whatever the batch, unless one fails), since the cache was made.
  int64_t table_waits() const { return table_waits_; }
  double table_wait_seconds() const { return table_wait_seconds_; }  // ... the time they took
  // The layers whose K/V are kept in backend memory too (StoreKvCacheOptions; 0 where not).
  int device_resident_layers() const {
    return resident_layers_ != nullptr ? resident_layers_->layers() : 0;
  }
  absl::StatusOr<int64_t> NumSlots(SequenceId seq, int layer) override;
  absl::Status Prefetch(SequenceId seq, int layer, const int32_t* slots, int64_t count,
                        int64_t extra_rows = 0, bool placed = false) override;
  RowPlacement Placement(SequenceId seq, int layer) const override;
  // Rows kept per (layer, KV head) for a sequence opened with this capacity (0: no reuse).
  int64_t ReuseRows(int64_t capacity_tokens) const;
  void BeginPrefetches() override { deferring_ = true; }
  void SubmitPrefetches() override;
  absl::StatusOr<KvLayerView> Fetch(SequenceId seq, int layer) override;
  // Counts the bytes a step read where rows are read in place (a copying prefetch counts what
  // it copied).
  void RecordFetch(SequenceId seq, int layer, const int32_t* slots, int64_t count) override;

  FetchCounters Counters(SequenceId seq) const override;
  uint64_t StoreId(SequenceId seq) const { return options_.id_base + seq; }

 private:
  struct Staging {
    std::unique_ptr<Buffer> k, v;  // backend memory
    // Host bounce buffers (backends without host access whose rows are copied, not gathered
    // by the device).
    std::vector<uint8_t> host_k, host_v;
    size_t capacity = 0;                      // bytes of each
    std::vector<const void*> k_rows, v_rows;  // row tables of a gather in place
  };
  // A gather in flight or done: one per layer parity, so that the next layer's rows can move
  // while this layer's are being used.
  struct Pending {
    Staging staging;
    // Where the GPU gathers by block table: the gather's slot list in backend memory
    // ([num_kv_heads, count] int32), sized when the sequence opens.
    std::unique_ptr<Buffer> device_slots;
    ClientGatherItem item;                 // what it gathers (kept to retry it alone)
    std::shared_ptr<GatherTicket> ticket;  // shared by the prefetches submitted together
    bool deferred = false;                 // held for SubmitPrefetches
    bool shared = false;                   // its ticket carries other sequences' items too
    int layer = -1;
    int64_t count = 0;
    int64_t extra_rows = 0;  // rows per head left free after the gathered ones
    int64_t head_rows = 0;   // staged rows per head (ReadStored's room after each); 0: count
    bool in_place = false;
    bool launched = false;   // its device gather is queued on the backend's side queue
    int64_t side_batch = 0;  // ... with the side_batches_-th batch
    bool resident = false;   // every row, copied from resident_layers_ at the fetch
    SequenceId seq = 0;      // the sequence it reads for
    // Row reuse: the misses of `plan` go into the layer's rows of `reused`' buffer (the item
    // asks the store for their block tables); `unsettled` until they are there, so that a
    // gather dropped or failed before makes the layer's rows unknown.
    bool reuse = false, unsettled = false;
    ReusedRows::Plan plan;
    ReusedRows* reused = nullptr;
  };
  // Staging a gather that did not finish in time may still write into: kept until it ends.
  struct Abandoned {
    Staging staging;
    std::shared_ptr<GatherTicket> ticket;
    std::shared_ptr<DeviceBlockTables> tables;  // ... and the block tables it answers into
  };
  struct Sequence {
    std::vector<int64_t> length;  // per layer
    // Per layer, the rows a gather's answer has covered since they were appended (TablesFor):
    // appends are write-behind, so a row the device reads from the arena without asking the
    // store may not have landed yet.
    std::vector<int64_t> answered;
    // Per layer, the rows handed to the store client (a step's held appends are not: they are
    // sent at its end).
    std::vector<int64_t> sent;
    bool device_decode = false;  // a decode token of the current step planned on the device
    Pending pending[2];
    FetchCounters counters;
    std::unique_ptr<PooledSlots> pool;  // with options.pool: where each token is stored
    // Where the GPU gathers by block table (device_gathers_): the store's block tables of every
    // layer, mirrored on the device. Shared with gathers abandoned late, which may still write.
    std::shared_ptr<DeviceBlockTables> tables;
    // Row reuse (StoreKvCacheOptions::reuse_rows): what is kept, and where: K then V of each
    // layer from reuse_first_layer_, [num_kv_heads, rows + 1] each (a row per head after them
    // for the caller's extra row). The buffer is dropped when the sequence idles.
    std::unique_ptr<ReusedRows> reused;
    std::unique_ptr<Buffer> reuse_buffer;
    // ... or, planned on the device (plan_on_device), its bookkeeping there: int32 [layers,
    // heads, map_capacity] row_of, [layers, heads, rows] slot_of, then two layers in flight's
    // moves, a plan's workspace, a choice's rows and misses, and the counts (rows moved and
    // misses per layer and head, errors) with their host copy.
    struct Kept {
      std::unique_ptr<Buffer> buffer;
      int64_t layers = 0, heads = 0, map_capacity = 0, rows = 0;  // (its layout)
      std::vector<int32_t> counts;  // host: moved, missed, listed [layers, heads] each, errors
      bool planned = false;         // since the last settle
      bool queued = false;          // its counts' copy to the host
    };
    std::unique_ptr<Kept> kept;
    // Slots stored in `layer`: its length, or in a KV pool the slots in use.
    int64_t Rows(int layer) const { return pool ? pool->rows(layer) : length[layer]; }
  };

  absl::StatusOr<Sequence*> Find(SequenceId seq);
  // A new sequence's two stagings come from those ended sequences left (so that a decode step
  // of a batch that grows allocates nothing once the batch has been that large): for each, the
  // largest spare that is not larger than `bytes` (a sequence never holds more than
  // BackendBytesFor says; a smaller one is reallocated). An ended or idle sequence's go back,
  // up to kSpareStagings.
  void TakeSpareStaging(Sequence& s, size_t bytes);
  void KeepSpareStaging(Sequence& s);
  // Backend bytes of one of a sequence's two stagings at this capacity (K and V); 0 where rows
  // are read in place.
  size_t StagingBytes(int64_t capacity_tokens) const;
  // Attach's and Fork's check that `seq` can be opened ("attached", "forked": what it says).
  absl::Status CheckNewSequence(SequenceId seq, const char* verb) const;
  // Opens `seq` holding `rows` rows in every layer, its staging sized for `capacity_tokens`.
  absl::Status OpenWithRows(SequenceId seq, int64_t rows, int64_t capacity_tokens);
  // Sizes a sequence's staging (both layers in flight) for a read of all its rows at its
  // capacity, when it is opened: decode steps then allocate none.
  absl::Status SizeStaging(Sequence& s, int64_t capacity_tokens);
  // Drops `seq`'s state here (its staging kept for reuse); false when unknown.
  bool Forget(SequenceId seq);
  static constexpr size_t kSpareStagings = 32;
  SequenceSpec Spec() const;  // how this cache's sequences are stored
  // Room for `bytes` in each of s's K and V: exactly (Open), or grown by half at least.
  absl::Status EnsureStaging(Staging& s, size_t bytes, bool exact = false);
  // Starts gathering `count` slots per head into the sequence's staging (`in_place`: their
  // addresses into its row tables).
  absl::Status StartGather(SequenceId seq, Sequence& s, int layer, std::span<const int32_t> slots,
                           int64_t count, int64_t extra_rows, bool in_place);
  absl::StatusOr<KvLayerView> FinishGather(Sequence& s, int layer);
  // A read of rows 0 .. count-1 of every head that resident_layers_ answers (StartGather's
  // counterpart: nothing crosses the link, the rows are copied at FinishGather); false when
  // they are not all there (the store's then).
  bool StartResident(SequenceId seq, Sequence& s, int layer, int64_t count, int64_t extra_rows);
  // Ends an outstanding gather (waits for it so its buffers can be reused or freed; a device
  // gather on the side queue is joined, so that later work on its staging comes after it).
  void DropTicket(Pending& p);
  // A GPU backend's in-place prefetch: p's slots, found in s's block tables on the device, read
  // from the registered arena into p's device staging (Backend::GatherBlockRows), on the
  // backend's queue (at the fetch) or its side queue (launched with the batch's prefetches, so
  // that the rows cross the link while the layer before computes).
  absl::Status GatherOnDevice(Sequence& s, Pending& p, bool on_side_queue = false);
  // ... of a reuse prefetch: the plan's misses into the rows it freed for them.
  absl::Status GatherMissesOnDevice(Sequence& s, Pending& p, bool on_side_queue);
  // `g` (its lists, counts and destination rows set) from the registered arena by s's block
  // tables of `layer`, into k and then v (forked onto the side queue first if g says so);
  // registers the arena again once if the backend no longer knows it (a restarted store's).
  absl::Status GatherKAndV(Sequence& s, int layer, BlockRowsGather g, void* k, void* v);
  // Row reuse's prefetch (StoreKvCacheOptions::reuse_rows): the list planned against the rows
  // the layer keeps, the store asked for the misses' block tables only, nothing asked when
  // every row is kept. false (nothing started) where reuse does not apply: the caller gathers.
  absl::StatusOr<bool> StartReuse(SequenceId seq, Sequence& s, int layer, const int32_t* slots,
                                  int64_t count, int64_t extra_rows);
  // Backend bytes of a sequence's reuse buffer, and where a layer's K rows are in it.
  size_t ReuseBufferBytes(int64_t rows) const;
  uint8_t* ReusedK(Sequence& s, int layer) const;
  uint8_t* ReusedV(Sequence& s, int layer) const;
  // Opens s's row reuse for this capacity (its buffer allocated) where options_ ask for it.
  absl::Status OpenReuse(Sequence& s, int64_t capacity_tokens);
  // Rows per KV head of a layer's reuse buffer for a choice's rows not kept (device planning).
  int64_t MissRows() const { return device_plans_ ? kMissRows : 0; }
  // Device planning's state for s (its maps all -1), made or reset when its reuse opens.
  absl::Status OpenKept(Sequence& s, int64_t capacity_tokens);
  // Every row of `layer` unknown again (a planned move that did not happen).
  absl::Status ForgetKept(Sequence& s, int layer);
  // s, when rows [0, rows) of its `layer` can be read as stored with `room` rows after each
  // head's (ReadStored, PrefetchStored); else INVALID_ARGUMENT.
  absl::StatusOr<Sequence*> StoredRowsOf(SequenceId seq, int layer, int64_t rows, int64_t room);
  // Slots 0 .. rows - 1 of every KV head ([num_kv_heads, rows], in every_slot_).
  std::span<const int32_t> EverySlot(int64_t rows);
  KeptRows KeptOf(Sequence& s, int layer) const;
  // s's block tables of `layer` cover its first `rows` rows, and an answer of the store came
  // after them (they landed): a gather of the blocks the layer gained, asked for when the
  // layer has rows no answer covered (once a step: the step before appended a row). Every
  // later layer of s, and the other sequences planned on the device, are asked along
  // (AsksAlongside): one store wait a step, not one a sequence; if that gather fails, s asks
  // alone.
  absl::Status TablesFor(SequenceId seq, Sequence& s, int layer, int64_t rows);
  // Whether s's tables of `layer` miss blocks of its first `rows` rows or an answer after them.
  bool AsksStore(const Sequence& s, int layer, int64_t rows) const;
  // ... for s asked along with another sequence: a decode of this step planned on the device,
  // its rows sent, where nothing of its own answers into those tables.
  bool AsksAlongside(const Sequence& s, int layer) const;
  // A reuse prefetch's misses copied by the transport into staging (host memory: a CPU
  // backend), each into its row.
  void PlaceCopiedMisses(Sequence& s, Pending& p);
  // FinishGather of a reuse prefetch: its misses moved (waited for, joined, or gathered now),
  // and the layer's kept rows answered, head_stride apart (Placement says where each is).
  absl::StatusOr<KvLayerView> FinishReuse(Sequence& s, Pending& p);
  // SubmitPrefetches' device gathers whose tickets are done: launched on the side queue (a
  // fork before each, after its slot list's copy), joined at their first Fetch, or before the
  // next batch is launched, whichever comes first.
  void LaunchOnSideQueue(std::span<Pending* const> pendings);
  // Joins the side queue if p's gather is on it and not joined yet.
  absl::Status JoinSideQueue(const Pending& p);
  // Room in s's block tables for `rows` rows a layer, on the device (again after Idle). Past
  // what the sequence was opened with (rare: the capacity is a hint) the tables move, so that
  // gathers writing into them are waited for first.
  absl::Status ReserveTables(Sequence& s, int64_t rows);
  // Backend bytes of a sequence's block tables and slot lists at this capacity (device gathers).
  size_t GatherTableBytes(int64_t capacity_tokens) const;
  // ... of its block tables alone (as many on the host); 0 without device gathers.
  size_t TableBytes(int64_t capacity_tokens) const;
  // Waits for p's gather; retries it alone if a gather it shared failed or did not finish in
  // time (then every sequence of that gather retries alone, at once: RegatherAlone).
  absl::Status WaitGather(Sequence& s, Pending& p);
  // The gathers of every sequence that shared `late` again, each alone and into new staging
  // (the late transfer may still write into the old: abandoned_).
  void RegatherAlone(const std::shared_ptr<GatherTicket>& late);
  // Points p.item at p's staging, sized for it.
  absl::Status BindStaging(Pending& p);
  void ReapAbandoned(bool wait);
  std::vector<Abandoned> abandoned_;
  size_t RowBytes() const;
  // Copies the rows of `m` (backend memory, possibly strided) packed to host memory `out`.
  absl::Status RowsToHost(MatView m, uint8_t* out);
  // The sequence an append at (layer, start) goes to, if it may (open, in order).
  absl::StatusOr<Sequence*> AppendTarget(SequenceId seq, int layer, int64_t start);
  // Places n rows of `layer` from `start`: their slots (a KV pool's in `slots`, which the store
  // is sent with them; none otherwise) to slots_out, and the layer's length.
  absl::Status Place(Sequence& s, int layer, int64_t start, int64_t n, std::vector<int32_t>& slots,
                     int32_t* slots_out);
  // BeginAppendLayer's packed items, sent at EndAppendLayer from both_.
  struct LaterAppend {
    size_t item;
    SequenceId seq;
    int layer;
    int64_t start, n;
    size_t offset;  // of its K rows in both_ (its V rows follow)
    std::vector<int32_t> slots;
  };
  std::vector<LaterAppend> later_appends_;
  uint64_t later_copy_ = 0;   // backend_.host_copies_done() when their copy was queued
  uint64_t counts_copy_ = 0;  // ... when QueueDeviceCounts queued the plans' counts
  bool copy_queued_ = false;  // ... and not yet ended
  // BeginAppendStep: the layers' appends accumulate (at these offsets of pack_ and both_) until
  // EndAppendLayer.
  bool step_appends_ = false;
  size_t step_offset_ = 0;
  bool device_plans_ = false;        // options.plan_on_device where it applies
  std::vector<SequenceId> planned_;  // sequences planned on the device since the last settle
  std::vector<ClientGatherItem> table_items_;  // TablesFor's (their slot lists' room kept)
  std::vector<SequenceId> step_decodes_;       // BeginAppendStep's (device_decode set)
  bool along_refused_ = false;     // a call asking for several was refused this step: ask alone
  int64_t table_waits_ = 0;        // ... calls waited for
  double table_wait_seconds_ = 0;  // ... and the time they took
  int device_side_layer_ = -1;     // the layer whose device prefetches make the open side batch
  std::vector<int64_t> side_batch_of_layer_;  // the last side batch each layer's went with
  // The side batch (side_batches_' number) the gathers of `layer` are launched with.
  absl::StatusOr<int64_t> SideBatchFor(int layer);

  Backend& backend_;
  KvCacheShape shape_;
  KvStoreClient& client_;
  StoreKvCacheOptions options_;
  bool host_access_;  // the backend's memory is host memory (CPU): gather straight into it
  bool in_place_;     // prefetches answer row addresses (see StoreKvCacheOptions)
  bool device_gathers_ = false;       // ... which a GPU backend gathers (device_reads_mapped_rows)
  int64_t rows_per_block_ = 0;        // ... by block table: the store's rows per arena block
  int reuse_first_layer_ = 0;         // row reuse: the first layer kept (after resident ones)
  const void* registered_ = nullptr;  // the client's mapped memory registered with the backend
  uint64_t registered_generation_ = 0;  // ... its KvStoreClient::Span::generation
  absl::Status registration_status_;
  // Registers the client's mapped memory with the backend if it is not (again after a store
  // restart remapped it).
  absl::Status RegisterMapped();
  absl::flat_hash_map<SequenceId, Sequence> sequences_;
  bool deferring_ = false;  // between BeginPrefetches and SubmitPrefetches
  std::vector<std::pair<SequenceId, int>> deferred_;  // (sequence, layer parity) held
  std::vector<Staging> spare_staging_;
  std::vector<std::unique_ptr<Buffer>> spare_reuse_;  // ended sequences' row reuse buffers
  size_t spare_bytes_ = 0;  // their backend memory (K and V), and the reuse buffers'
  // Scratch kept between steps (capacity reused: a decode step allocates nothing on the host
  // with the in-process transport): SubmitPrefetches' items (a prefix of them in use)
  // and their Pendings, ReadAll's slot list, and an append's rows packed on the host and its
  // KV pool slots.
  std::vector<ClientGatherItem> batch_items_;
  std::vector<Pending*> batch_group_;
  std::vector<Pending*> side_launch_;  // ... and those whose device gathers may go early
  // Batches of gathers launched on the side queue, and the last one a join covers.
  int64_t side_batches_ = 0, side_joined_ = 0;
  std::vector<int32_t> every_slot_;
  std::vector<uint8_t> host_k_, host_v_;
  std::vector<int32_t> place_slots_;
  std::unique_ptr<Buffer> pack_;  // RowsToHost's packed rows on backends without host access
  // Appends of at most this many tokens (decode steps) copy K and V out together.
  static constexpr int64_t kPackedAppendRows = 16;
  std::vector<uint8_t> both_;                        // their host copy
  std::vector<Sequence*> append_targets_;            // AppendLayer's, per item (null: refused)
  std::unique_ptr<ResidentLayers> resident_layers_;  // with options.device_resident_layers
};

}  // namespace infinigen
