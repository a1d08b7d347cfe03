#include "gpu_worker/kv/store_kv_cache.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen {

StoreKvCache::StoreKvCache(Backend& backend, const KvCacheShape& shape, KvStoreClient& client,
                           const StoreKvCacheOptions& options)
    : backend_(backend),
      shape_(shape),
      client_(client),
      options_(options),
      host_access_(backend.host_accessible()),
      in_place_(host_access_ && options.read_in_place && client.reads_in_place()) {
  table_items_.resize(static_cast<size_t>(std::max(shape.num_layers, 0)));
  side_batch_of_layer_.assign(static_cast<size_t>(std::max(shape.num_layers, 0)), 0);
  // Without registration (a backend or device that cannot) prefetches copy as before.
  if (!host_access_ && options.read_in_place && options.device_reads_mapped_rows &&
      client.reads_in_place()) {
    registration_status_ = RegisterMapped();
    device_gathers_ = registration_status_.ok() && rows_per_block_ > 0;
  }
  if (!host_access_ && !options.pool && options.device_resident_layers > 0) {
    resident_layers_ =
        std::make_unique<ResidentLayers>(backend, shape, options.device_resident_layers);
  }
  reuse_first_layer_ = device_resident_layers();
  device_plans_ = device_gathers_ && options.plan_on_device && !options.pool &&
                  options.reuse_rows != nullptr && reuse_first_layer_ < shape.num_layers;
}

StoreKvCache::~StoreKvCache() {
  // A copy still queued into both_ lands before both_ goes.
  if (copy_queued_ && backend_.host_copies_done() == later_copy_) {
    backend_.Synchronize().IgnoreError();
  }
  std::vector<SequenceId> open;
  for (const auto& [seq, s] : sequences_) open.push_back(seq);
  for (SequenceId seq : open) Close(seq);
  ReapAbandoned(/*wait=*/true);
}

size_t StoreKvCache::RowBytes() const {
  return static_cast<size_t>(shape_.head_dim) * DTypeSize(shape_.dtype);
}

absl::StatusOr<StoreKvCache::Sequence*> StoreKvCache::Find(SequenceId seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  return &it->second;
}

SequenceSpec StoreKvCache::Spec() const {
  SequenceSpec spec;
  spec.num_layers = shape_.num_layers;
  spec.num_kv_heads = shape_.num_kv_heads;
  spec.head_dim = shape_.head_dim;
  spec.dtype = shape_.dtype;
  spec.owner = options_.owner;
  return spec;
}

absl::Status StoreKvCache::Open(SequenceId seq, int64_t capacity_tokens) {
  if (sequences_.contains(seq)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " is already open"));
  }
  SequenceSpec spec = Spec();
  std::unique_ptr<PooledSlots> pool;
  if (options_.pool) {
    const int64_t share = options_.pool->CapacityFor(capacity_tokens);
    pool = std::make_unique<PooledSlots>(shape_.num_layers, shape_.num_kv_heads, share,
                                         options_.pool->eviction);
    // Room in the store for every slot this cache may choose: its share, or a longer prompt.
    spec.capacity_tokens = std::max(share, capacity_tokens);
    spec.eviction = options_.pool->eviction;
  }
  IG_RETURN_IF_ERROR(client_.Open(StoreId(seq), spec));
  Sequence& s = sequences_[seq];
  s.length.assign(shape_.num_layers, 0);
  s.answered.assign(shape_.num_layers, 0);
  s.sent.assign(shape_.num_layers, 0);
  s.pool = std::move(pool);
  TakeSpareStaging(s, StagingBytes(capacity_tokens));
  absl::Status st = SizeStaging(s, capacity_tokens);
  if (st.ok()) st = OpenReuse(s, capacity_tokens);
  if (st.ok() && resident_layers_ != nullptr) st = resident_layers_->Open(seq, capacity_tokens);
  if (!st.ok()) Close(seq);  // the store's too: a retry (the backend full now) opens it anew
  return st;
}

size_t StoreKvCache::StagingBytes(int64_t capacity_tokens) const {
  if (in_place_) return 0;
  const size_t entries =
      static_cast<size_t>(shape_.num_kv_heads) * static_cast<size_t>(capacity_tokens + 1);
  return 2 * entries * RowBytes();
}

size_t StoreKvCache::BackendBytesFor(int64_t capacity_tokens) const {
  const int64_t capacity = std::max<int64_t>(capacity_tokens, 0);
  const int64_t reused = ReuseRows(capacity);
  size_t bytes = 2 * StagingBytes(capacity) + GatherTableBytes(capacity) + ReuseBufferBytes(reused);
  if (device_plans_ && reused > 0) {  // the device's bookkeeping (store_kv_cache_device_plan.cc)
    const size_t layers = static_cast<size_t>(shape_.num_layers - reuse_first_layer_);
    const size_t heads = static_cast<size_t>(shape_.num_kv_heads);
    const size_t r = static_cast<size_t>(reused);
    bytes += sizeof(int32_t) * (layers * heads * (static_cast<size_t>(capacity) + 1 + r) +
                                heads * (4 * (r + 1) + r + 2 * (r + 1)) + 3 * layers * heads + 1);
  }
  if (resident_layers_ != nullptr) {
    bytes += ResidentLayers::BytesPerToken(shape_, resident_layers_->layers()) *
             static_cast<size_t>(capacity);
  }
  return bytes;
}

absl::Status StoreKvCache::SizeStaging(Sequence& s, int64_t capacity_tokens) {
  // The most one read of a layer moves: every row (a dense layer, a full fetch) and the current
  // token's, so that no decode step allocates (or, on a GPU, waits for a free).
  const size_t entries = static_cast<size_t>(shape_.num_kv_heads) * (capacity_tokens + 1);
  // A gather's slot list on the device: as many, or row reuse's moves (ReusedRows::Plan).
  const size_t slot_entries =
      std::max(entries, static_cast<size_t>(shape_.num_kv_heads) *
                            static_cast<size_t>(2 * ReuseRows(capacity_tokens) + 1));
  if (device_gathers_) {
    if (s.tables == nullptr) {
      s.tables = std::make_shared<DeviceBlockTables>(shape_.num_layers, shape_.num_kv_heads,
                                                     rows_per_block_);
    }
    IG_RETURN_IF_ERROR(s.tables->Reserve(backend_, capacity_tokens + 1));
  }
  for (Pending& p : s.pending) {
    p.item.slots.reserve(entries);
    if (in_place_) {
      p.staging.k_rows.reserve(entries);
      p.staging.v_rows.reserve(entries);
    }
    if (device_gathers_ &&
        (p.device_slots == nullptr || p.device_slots->size() < slot_entries * sizeof(int32_t))) {
      p.device_slots.reset();
      IG_ASSIGN_OR_RETURN(p.device_slots, backend_.Allocate(slot_entries * sizeof(int32_t)));
    }
    if (!in_place_) IG_RETURN_IF_ERROR(EnsureStaging(p.staging, entries * RowBytes(), true));
  }
  return absl::OkStatus();
}

void StoreKvCache::TakeSpareStaging(Sequence& s, size_t bytes) {
  for (Pending& p : s.pending) {
    // The largest spare within `bytes` (its K and V); in place, any (host row tables only).
    auto best = spare_staging_.end();
    for (auto it = spare_staging_.begin(); it != spare_staging_.end(); ++it) {
      if (!in_place_ && 2 * it->capacity > bytes) continue;
      if (best == spare_staging_.end() || it->capacity > best->capacity) best = it;
    }
    if (best == spare_staging_.end()) return;
    spare_bytes_ -= 2 * best->capacity;
    p.staging = std::move(*best);
    *best = std::move(spare_staging_.back());
    spare_staging_.pop_back();
  }
}

void StoreKvCache::KeepSpareStaging(Sequence& s) {
  for (Pending& p : s.pending) {
    DropTicket(p);  // nothing writes into it any more (both Pendings, even when not kept)
    p.device_slots.reset();
    Staging staging = std::move(p.staging);
    p.staging = Staging{};
    if (staging.capacity == 0 && staging.k_rows.capacity() == 0) continue;
    if (spare_staging_.size() >= kSpareStagings) continue;  // freed here
    spare_bytes_ += 2 * staging.capacity;
    spare_staging_.push_back(std::move(staging));
  }
  // Its other backend memory goes too (until an Attach opens it again).
  if (s.tables != nullptr) s.tables->Release();
  if (s.reuse_buffer != nullptr && spare_reuse_.size() < kSpareStagings) {
    spare_bytes_ += s.reuse_buffer->size();
    spare_reuse_.push_back(std::move(s.reuse_buffer));
  }
  s.reuse_buffer.reset();
  s.kept.reset();  // made again with the buffer (OpenReuse)
  if (s.reused != nullptr) s.reused->ForgetAll();
}

size_t StoreKvCache::HostBytesFor(int64_t capacity_tokens) const {
  const size_t entries = static_cast<size_t>(shape_.num_kv_heads) *
                         static_cast<size_t>(std::max<int64_t>(capacity_tokens, 0) + 1);
  size_t per_layer = entries * sizeof(int32_t);
  if (in_place_) per_layer += 2 * entries * sizeof(const void*);
  if (!host_access_ && !device_gathers_) per_layer += 2 * entries * RowBytes();
  // Where the GPU gathers by block table, the tables' host copy (as large as the device's), and
  // row reuse's bookkeeping and the two layers' plans.
  const int64_t reused = ReuseRows(std::max<int64_t>(capacity_tokens, 0));
  const size_t reuse = reused > 0
                           ? ReusedRows::BytesFor(shape_.num_layers, shape_.num_kv_heads, reused) +
                                 2 * ReusedRows::PlanBytesFor(shape_.num_kv_heads, reused)
                           : 0;
  return 2 * per_layer + TableBytes(std::max<int64_t>(capacity_tokens, 0)) + reuse;
}

size_t StoreKvCache::HostStagingBytes() const {
  size_t bytes = 0;
  auto add = [&](const Staging& st) { bytes += st.host_k.capacity() + st.host_v.capacity(); };
  for (const auto& [seq, s] : sequences_) {
    for (const Pending& p : s.pending) add(p.staging);
  }
  for (const Staging& st : spare_staging_) add(st);
  return bytes;
}

void StoreKvCache::ReleaseSpares() {
  spare_staging_.clear();
  spare_reuse_.clear();
  spare_bytes_ = 0;
}

void StoreKvCache::Idle(SequenceId seq) {
  if (resident_layers_ != nullptr) resident_layers_->Close(seq);
  auto it = sequences_.find(seq);
  if (it != sequences_.end()) KeepSpareStaging(it->second);
}

absl::Status StoreKvCache::CheckNewSequence(SequenceId seq, const char* verb) const {
  if (sequences_.contains(seq)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " is already open"));
  }
  if (options_.pool) {
    return absl::FailedPreconditionError(
        absl::StrCat("a KV pool sequence cannot be ", verb, ": its slots are not positions"));
  }
  return absl::OkStatus();
}

absl::Status StoreKvCache::OpenWithRows(SequenceId seq, int64_t rows, int64_t capacity_tokens) {
  Sequence& s = sequences_[seq];
  s.length.assign(shape_.num_layers, rows);
  s.answered.assign(shape_.num_layers, 0);  // (asked again at the first step planned on the device)
  s.sent.assign(shape_.num_layers, rows);
  const int64_t capacity = std::max(capacity_tokens, rows);
  TakeSpareStaging(s, StagingBytes(capacity));
  absl::Status st = SizeStaging(s, capacity);
  if (st.ok()) st = OpenReuse(s, capacity);
  // Nothing half open: the caller computes the rows instead (an attached sequence's stored KV
  // goes with it; a prefill replaces it).
  if (!st.ok()) Close(seq);
  return st;
}

absl::StatusOr<int64_t> StoreKvCache::Attach(SequenceId seq, uint64_t home, int64_t max_length,
                                             int64_t capacity_tokens) {
  IG_RETURN_IF_ERROR(CheckNewSequence(seq, "attached"));
  IG_ASSIGN_OR_RETURN(const int64_t kept, client_.Attach(home, StoreId(seq), Spec(), max_length));
  // One of this cache's own sequences (a conversation's next request): its old id is gone.
  if (home > options_.id_base) {
    auto own = sequences_.find(home - options_.id_base);
    if (own != sequences_.end()) {
      if (resident_layers_ != nullptr) resident_layers_->Close(own->first);
      KeepSpareStaging(own->second);
      sequences_.erase(own);
    }
  }
  IG_RETURN_IF_ERROR(OpenWithRows(seq, kept, capacity_tokens));
  return kept;
}

absl::StatusOr<int64_t> StoreKvCache::Fork(SequenceId seq, SequenceId parent, int64_t length,
                                           int64_t capacity_tokens) {
  IG_RETURN_IF_ERROR(CheckNewSequence(seq, "forked"));
  if (!sequences_.contains(parent)) {
    return absl::NotFoundError(absl::StrCat("sequence ", parent, " is not open"));
  }
  IG_ASSIGN_OR_RETURN(const int64_t copied,
                      client_.Fork(StoreId(parent), StoreId(seq), Spec(), length));
  IG_RETURN_IF_ERROR(OpenWithRows(seq, copied, capacity_tokens));
  return copied;
}

void StoreKvCache::DropTicket(Pending& p) {
  // Misses that may not have reached the layer's rows: what the rows hold is not known.
  if (p.reuse && p.unsettled && p.reused != nullptr) p.reused->Forget(p.layer);
  p.reuse = p.unsettled = false;
  if (p.launched) {
    JoinSideQueue(p).IgnoreError();
    p.launched = false;
  }
  if (p.ticket != nullptr) {
    // The transfer writes into our staging buffers: wait for it whoever else holds the ticket.
    p.ticket->Wait(absl::InfiniteFuture()).IgnoreError();
    p.ticket.reset();
  }
  p.deferred = false;
  p.layer = -1;
  p.head_rows = 0;
}

bool StoreKvCache::Forget(SequenceId seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return false;
  KeepSpareStaging(it->second);
  sequences_.erase(it);
  if (resident_layers_ != nullptr) resident_layers_->Close(seq);
  return true;
}

void StoreKvCache::Close(SequenceId seq) {
  // Failures are the store's to clean up: the lease frees what a Close could not.
  if (Forget(seq)) client_.Close(StoreId(seq)).IgnoreError();
}

void StoreKvCache::Release(SequenceId seq) {
  // A failed Release is retried by the client; the lease frees what nobody takes over.
  if (Forget(seq)) client_.Release(StoreId(seq)).IgnoreError();
}

absl::StatusOr<bool> StoreKvCache::HasRoomFor(int64_t tokens) {
  IG_ASSIGN_OR_RETURN(const KvStoreStats stats, client_.Stats());
  const int64_t row = static_cast<int64_t>(RowBytes());
  if (stats.block_bytes < row) return absl::UnimplementedError("the store reports no block size");
  const int64_t rows_per_block = stats.block_bytes / row;
  const int64_t blocks = 2 * int64_t{shape_.num_layers} * shape_.num_kv_heads *
                         ((tokens + rows_per_block - 1) / rows_per_block);
  return blocks * stats.block_bytes <= stats.bytes_capacity - stats.bytes_used;
}

absl::StatusOr<int64_t> StoreKvCache::Length(SequenceId seq) const {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  return it->second.length.back();
}

absl::StatusOr<int64_t> StoreKvCache::NumSlots(SequenceId seq, int layer) {
  IG_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  return s->Rows(layer);
}

absl::Status StoreKvCache::Append(SequenceId seq, int layer, int64_t start, MatView k, MatView v,
                                  int32_t* slots_out) {
  const LayerAppend item{seq, start, k, v, slots_out};
  absl::Status status;
  AppendLayer(layer, {&item, 1}, {&status, 1});
  return status;
}

absl::StatusOr<StoreKvCache::Sequence*> StoreKvCache::AppendTarget(SequenceId seq, int layer,
                                                                   int64_t start) {
  IG_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  if (start != s->length[layer]) {
    return absl::InvalidArgumentError(
        absl::StrCat("the KV store appends in order: layer ", layer, " of sequence ", seq,
                     " holds ", s->length[layer], " tokens, append starts at ", start));
  }
  return s;
}

void StoreKvCache::AppendLayer(int layer, std::span<const LayerAppend> items,
                               std::span<absl::Status> statuses) {
  BeginAppendLayer(layer, items, statuses);
  if (copy_queued_) {
    if (absl::Status st = backend_.Synchronize(); !st.ok()) {
      for (const LaterAppend& l : later_appends_) statuses[l.item] = st;
      later_appends_.clear();
      copy_queued_ = false;
      return;
    }
  }
  EndAppendLayer();
}

void StoreKvCache::BeginAppendLayer(int layer, std::span<const LayerAppend> items,
                                    std::span<absl::Status> statuses) {
  if (copy_queued_ && !step_appends_) {
    // A Begin without its End (the step failed between them): the copy into both_ must land
    // before both_ is reused; those rows are dropped (their sequences failed with the step).
    if (backend_.host_copies_done() == later_copy_) backend_.Synchronize().IgnoreError();
    copy_queued_ = false;
    later_appends_.clear();
  }
  const size_t row = static_cast<size_t>(shape_.num_kv_heads) * RowBytes();
  append_targets_.assign(items.size(), nullptr);
  // Decode tokens on a device: every such item's K and V packed there, one copy out (no wait
  // of its own: the caller's next wait brings them), handed to the store at EndAppendLayer.
  // Prompt chunks and host backends copy item by item, now; within a step's appends
  // (BeginAppendStep) prompt chunks are held too (their attention reads the rows stored before
  // them, ReadStored, and their own from the activations).
  auto packed = [&](const LayerAppend& a) {
    return !host_access_ && (step_appends_ || a.k.rows <= kPackedAppendRows);
  };
  size_t packed_bytes = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    absl::StatusOr<Sequence*> s = AppendTarget(items[i].seq, layer, items[i].start);
    statuses[i] = s.status();
    if (!s.ok()) continue;
    append_targets_[i] = *s;
    if (packed(items[i])) packed_bytes += 2 * static_cast<size_t>(items[i].k.rows) * row;
  }
  auto fail_all = [&](const absl::Status& st) {
    for (size_t i = 0; i < items.size(); ++i) {
      if (append_targets_[i] != nullptr) statuses[i] = st;
    }
  };
  // Within a step's appends (BeginAppendStep) each layer's rows follow the last's, in room
  // sized for the step: nothing moves while their copies are queued.
  const size_t base = step_appends_ ? step_offset_ : 0;
  if (step_appends_ && packed_bytes > 0 &&
      (pack_ == nullptr || base + packed_bytes > pack_->size() ||
       base + packed_bytes > both_.size())) {
    return fail_all(absl::InternalError("a step's appends outgrew the room BeginAppendStep made"));
  }
  if (packed_bytes > 0) {
    if (!step_appends_ && (pack_ == nullptr || pack_->size() < packed_bytes)) {
      // Grows by half at least, so that a batch growing one sequence at a time reallocates
      // rarely; 64 rows at first.
      const size_t old = pack_ == nullptr ? 0 : pack_->size();
      absl::StatusOr<std::unique_ptr<Buffer>> grown =
          backend_.Allocate(std::max({packed_bytes, old + old / 2, 64 * row}));
      if (!grown.ok()) return fail_all(grown.status());
      pack_ = *std::move(grown);
    }
    uint8_t* p = static_cast<uint8_t*>(pack_->data()) + base;
    size_t offset = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const LayerAppend& a = items[i];
      if (append_targets_[i] == nullptr || !packed(a)) continue;
      const int64_t n = a.k.rows, cols = a.k.cols;
      absl::Status st = backend_.Copy(a.k, MatView{p + offset, shape_.dtype, n, cols, cols});
      if (st.ok()) {
        st = backend_.Copy(a.v, MatView{p + offset + n * row, shape_.dtype, n, cols, cols});
      }
      if (!st.ok()) return fail_all(st);
      offset += 2 * n * row;
    }
    if (!step_appends_) both_.resize(packed_bytes);
    if (absl::Status st = backend_.CopyToHostLater(p, both_.data() + base, packed_bytes);
        !st.ok()) {
      return fail_all(st);
    }
    if (step_appends_) step_offset_ += packed_bytes;
    later_copy_ = backend_.host_copies_done();
    copy_queued_ = true;
  }
  size_t offset = base;
  for (size_t i = 0; i < items.size(); ++i) {
    Sequence* s = append_targets_[i];
    if (s == nullptr) continue;
    const LayerAppend& a = items[i];
    const int64_t n = a.k.rows;
    const size_t at = offset;
    if (packed(a)) offset += 2 * n * row;
    // The device's copy first (a device operation), so that an item it fails goes nowhere.
    if (resident_layers_ != nullptr) {
      statuses[i] = resident_layers_->Append(a.seq, layer, a.start, a.k, a.v);
      if (!statuses[i].ok()) continue;
    }
    if (packed(a)) {
      LaterAppend later{i, a.seq, layer, a.start, n, at, {}};
      statuses[i] = Place(*s, layer, a.start, n, later.slots, a.slots_out);
      if (statuses[i].ok()) later_appends_.push_back(std::move(later));
    } else {
      // The client takes the rows before AppendAsync returns: this cache's scratch serves
      // every append.
      host_k_.resize(n * row);
      host_v_.resize(n * row);
      absl::Status st = RowsToHost(a.k, host_k_.data());
      if (st.ok()) st = RowsToHost(a.v, host_v_.data());
      if (st.ok()) {
        st = Place(*s, layer, a.start, n, place_slots_, a.slots_out);
        if (st.ok()) {
          client_.AppendAsync(StoreId(a.seq), layer, a.start, n, host_k_, host_v_, place_slots_);
          s->sent[layer] = a.start + n;
        }
      }
      statuses[i] = st;
    }
  }
}

void StoreKvCache::EndAppendLayer() {
  step_appends_ = false;
  step_offset_ = 0;
  if (!copy_queued_) return;
  copy_queued_ = false;
  // The rows arrive at the backend's first wait after their copy: the caller's, or this one.
  if (backend_.host_copies_done() == later_copy_) {
    if (absl::Status st = backend_.Synchronize(); !st.ok()) {
      later_appends_.clear();  // the device failed: the step fails with it
      return;
    }
  }
  const size_t row = static_cast<size_t>(shape_.num_kv_heads) * RowBytes();
  // Decode tokens' rows first, then prompt chunks': the next step's gathers of decode rows wait
  // only for the appends queued before theirs, not for a chunk's megabytes. (A sequence has one
  // append a layer in a step: no pair's order changes.)
  for (const bool decodes : {true, false}) {
    for (const LaterAppend& l : later_appends_) {
      if ((l.n <= kPackedAppendRows) != decodes) continue;
      const size_t bytes = static_cast<size_t>(l.n) * row;
      const std::span<const uint8_t> rows(both_.data() + l.offset, 2 * bytes);
      client_.AppendAsync(StoreId(l.seq), l.layer, l.start, l.n, rows.first(bytes),
                          rows.subspan(bytes), l.slots);
      if (auto it = sequences_.find(l.seq); it != sequences_.end()) {
        it->second.sent[l.layer] = l.start + l.n;
      }
    }
  }
  later_appends_.clear();
}

absl::Status StoreKvCache::Place(Sequence& s, int layer, int64_t start, int64_t n,
                                 std::vector<int32_t>& slots, int32_t* slots_out) {
  slots.clear();
  if (s.pool != nullptr) {
    // A prompt chunk past the share grows it (prefill attends by position); decode tokens evict.
    if (n > 1 && !s.pool->Fits(layer, n)) s.pool->Grow(s.pool->rows(layer) + n);
    slots.resize(static_cast<size_t>(n * shape_.num_kv_heads));
    IG_ASSIGN_OR_RETURN(const int64_t evicted, s.pool->Place(layer, start, n, slots.data()));
    if (layer == 0) s.counters.evictions += evicted;
    if (slots_out != nullptr) std::copy(slots.begin(), slots.end(), slots_out);
  } else if (slots_out != nullptr) {
    for (int64_t r = 0; r < n; ++r) {
      for (int g = 0; g < shape_.num_kv_heads; ++g) {
        slots_out[r * shape_.num_kv_heads + g] = static_cast<int32_t>(start + r);
      }
    }
  }
  s.length[layer] = start + n;
  return absl::OkStatus();
}

absl::Status StoreKvCache::RowsToHost(MatView m, uint8_t* out) {
  // Rows as the store keeps them: in the cache's dtype (activations converted by Backend::Copy).
  const size_t row = static_cast<size_t>(m.cols) * DTypeSize(shape_.dtype);
  const MatView packed{out, shape_.dtype, m.rows, m.cols, m.cols};
  if (m.dtype == shape_.dtype && m.stride == m.cols) {
    return backend_.CopyToHost(m.data, out, m.rows * row);
  }
  if (host_access_) return backend_.Copy(m, packed);
  // Device memory: pack the rows there first, so that one copy (one wait) moves them all.
  if (pack_ == nullptr || pack_->size() < m.rows * row) {
    IG_ASSIGN_OR_RETURN(pack_, backend_.Allocate(m.rows * row));
  }
  IG_RETURN_IF_ERROR(
      backend_.Copy(m, MatView{pack_->data(), shape_.dtype, m.rows, m.cols, m.cols}));
  return backend_.CopyToHost(pack_->data(), out, m.rows * row);
}

absl::Status StoreKvCache::EnsureStaging(Staging& st, size_t bytes, bool exact) {
  if (st.capacity >= bytes) return absl::OkStatus();
  // The old buffers freed first, so that the peak is no higher than what the sequence is
  // admitted for (staging sized at Open is exact: BackendBytesFor; it grows only where Open
  // does not size it, the copies of a backend that reads rows in place).
  const size_t cap = exact ? bytes : std::max(bytes, st.capacity + st.capacity / 2);
  st.k.reset();
  st.v.reset();
  st.capacity = 0;
  IG_ASSIGN_OR_RETURN(st.k, backend_.Allocate(cap));
  IG_ASSIGN_OR_RETURN(st.v, backend_.Allocate(cap));
  if (!host_access_ && !device_gathers_) {  // where a GPU gathers by address, it needs none
    st.host_k.resize(cap);
    st.host_v.resize(cap);
  }
  st.capacity = cap;
  return absl::OkStatus();
}

absl::Status StoreKvCache::StartGather(SequenceId seq, Sequence& s, int layer,
                                       std::span<const int32_t> slots, int64_t count,
                                       int64_t extra_rows, bool in_place) {
  Pending& p = s.pending[layer % 2];
  DropTicket(p);
  const size_t bytes = static_cast<size_t>(shape_.num_kv_heads) * count * RowBytes();
  p.resident = false;
  // Field by field, so that the slot list keeps its capacity from step to step.
  p.item.seq = StoreId(seq);
  p.item.layer = layer;
  p.item.count = count;
  p.item.slots.assign(slots.begin(), slots.end());
  p.item.k_out = p.item.v_out = nullptr;
  p.item.k_rows = p.item.v_rows = nullptr;
  p.count = count;
  p.extra_rows = extra_rows;
  p.head_rows = 0;
  p.in_place = in_place;
  p.seq = seq;
  p.item.block_table = BlockTableOut{};
  if (in_place && !host_access_) {  // the GPU gathers by block table: the store answers them
    IG_RETURN_IF_ERROR(ReserveTables(s, s.Rows(layer)));
    p.item.block_table = s.tables->Out(layer);
  }
  IG_RETURN_IF_ERROR(BindStaging(p));
  if (deferring_) {
    p.deferred = true;
    deferred_.emplace_back(seq, layer % 2);
  } else {
    p.ticket = client_.GatherAsync(std::span<const ClientGatherItem>(&p.item, 1));
    p.shared = false;
  }
  p.layer = layer;
  if (!in_place || !host_access_) s.counters.bytes_fetched += static_cast<int64_t>(2 * bytes);
  s.counters.bytes_full += 2 * static_cast<int64_t>(shape_.num_kv_heads) * s.Rows(layer) *
                           static_cast<int64_t>(RowBytes());
  s.counters.fetches += 1;
  return absl::OkStatus();
}

absl::Status StoreKvCache::BindStaging(Pending& p) {
  ClientGatherItem& item = p.item;
  const size_t entries = static_cast<size_t>(shape_.num_kv_heads * (p.count + p.extra_rows));
  if (p.in_place) {
    if (!host_access_) return absl::OkStatus();  // by block table (StartGather), no row tables
    p.staging.k_rows.resize(entries);
    p.staging.v_rows.resize(entries);
    item.k_rows = p.staging.k_rows.data();
    item.v_rows = p.staging.v_rows.data();
    return absl::OkStatus();
  }
  IG_RETURN_IF_ERROR(EnsureStaging(p.staging, entries * RowBytes()));
  item.k_out = host_access_ ? static_cast<uint8_t*>(p.staging.k->data()) : p.staging.host_k.data();
  item.v_out = host_access_ ? static_cast<uint8_t*>(p.staging.v->data()) : p.staging.host_v.data();
  return absl::OkStatus();
}

absl::StatusOr<KvLayerView> StoreKvCache::FinishGather(Sequence& s, int layer) {
  Pending& p = s.pending[layer % 2];
  if (p.layer != layer) {
    return absl::FailedPreconditionError(
        absl::StrCat("no rows of layer ", layer, " were prefetched"));
  }
  if (p.reuse) return FinishReuse(s, p);
  const int64_t count = p.count;
  if (p.resident) {  // a copy inside the device, after this step's appends
    const int64_t per_head = count + p.extra_rows;
    IG_RETURN_IF_ERROR(
        EnsureStaging(p.staging, static_cast<size_t>(shape_.num_kv_heads * per_head) * RowBytes()));
    IG_RETURN_IF_ERROR(resident_layers_->Read(p.seq, layer, count, p.staging.k->data(),
                                              p.staging.v->data(), count));
    KvLayerView view;
    view.num_slots = count;
    view.k = shape_.HeadMajor(p.staging.k->data(), count);
    view.v = shape_.HeadMajor(p.staging.v->data(), count);
    return view;
  }
  if (p.deferred) SubmitPrefetches();
  if (p.ticket != nullptr) {
    if (absl::Status st = WaitGather(s, p); !st.ok()) {
      DropTicket(p);
      return st;
    }
    p.ticket.reset();  // done; p.layer stays, so a second Fetch of the layer still works
    if (p.launched) {  // on the side queue since SubmitPrefetches: ordered before what follows
      const absl::Status joined = JoinSideQueue(p);
      p.launched = false;
      IG_RETURN_IF_ERROR(joined);
    } else if (!host_access_ && p.in_place) {  // the GPU reads registered store memory
      IG_RETURN_IF_ERROR(GatherOnDevice(s, p));
    } else if (!host_access_) {
      const size_t bytes = static_cast<size_t>(shape_.num_kv_heads) * count * RowBytes();
      IG_RETURN_IF_ERROR(
          backend_.CopyToDevice(p.staging.host_k.data(), p.staging.k->data(), bytes));
      IG_RETURN_IF_ERROR(
          backend_.CopyToDevice(p.staging.host_v.data(), p.staging.v->data(), bytes));
    }
  }
  KvLayerView view;
  view.num_slots = count;
  if (p.in_place && host_access_) {  // row tables: entry g * count + j is row j of KV head g
    view.k = {nullptr, shape_.dtype, count, 1, p.staging.k_rows.data()};
    view.v = {nullptr, shape_.dtype, count, 1, p.staging.v_rows.data()};
    return view;
  }
  const int64_t per_head = p.head_rows > 0 ? p.head_rows : count;
  view.k = shape_.HeadMajor(p.staging.k->data(), per_head);
  view.v = shape_.HeadMajor(p.staging.v->data(), per_head);
  return view;
}

void StoreKvCache::SubmitPrefetches() {
  deferring_ = false;
  // The items are copied into batch_items_' first `count` entries (assignment keeps their slot
  // lists' capacity; clear() would free them).
  size_t count = 0;
  std::vector<Pending*>& group = batch_group_;
  group.clear();
  size_t bytes = 0;
  auto submit = [&] {
    if (count == 0) return;
    std::shared_ptr<GatherTicket> ticket =
        client_.GatherAsync(std::span<const ClientGatherItem>(batch_items_.data(), count));
    for (Pending* p : group) {
      p->ticket = ticket;
      p->shared = group.size() > 1;
    }
    count = 0;
    group.clear();
    bytes = 0;
  };
  side_launch_.clear();
  for (const auto& [seq, parity] : deferred_) {
    auto it = sequences_.find(seq);
    if (it == sequences_.end()) continue;  // closed since
    Pending& p = it->second.pending[parity];
    if (!p.deferred) continue;  // dropped, or listed twice
    p.deferred = false;
    if (p.in_place && !host_access_) side_launch_.push_back(&p);
    const size_t item_bytes =
        p.in_place ? 0 : 2 * static_cast<size_t>(shape_.num_kv_heads) * p.item.count * RowBytes();
    if (count > 0 && bytes + item_bytes > options_.max_batched_gather_bytes) submit();
    if (batch_items_.size() == count) batch_items_.emplace_back();
    batch_items_[count++] = p.item;
    group.push_back(&p);
    bytes += item_bytes;
  }
  deferred_.clear();
  submit();
  LaunchOnSideQueue(side_launch_);
}

absl::Status StoreKvCache::WaitGather(Sequence& s, Pending& p) {
  const auto t0 = std::chrono::steady_clock::now();
  ReapAbandoned(/*wait=*/false);
  absl::Status st = p.ticket->Wait(absl::Now() + options_.fetch_timeout);
  // A gather of several sequences failed: this one's alone may not. If it is over, into the
  // same staging; if it did not finish in time (one of its sequences may be what is slow, or
  // the store), every sequence of it gathers alone again at once, into new staging.
  if (!st.ok() && p.shared) {
    if (absl::IsDeadlineExceeded(st)) {
      RegatherAlone(std::shared_ptr<GatherTicket>(p.ticket));
    } else {
      p.ticket = client_.GatherAsync(std::span<const ClientGatherItem>(&p.item, 1));
      p.shared = false;
    }
    st = p.ticket->Wait(absl::Now() + options_.fetch_timeout);
  }
  s.counters.wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

void StoreKvCache::RegatherAlone(const std::shared_ptr<GatherTicket>& late) {
  for (auto& [seq, s] : sequences_) {
    for (Pending& q : s.pending) {
      if (q.ticket != late) continue;
      // New staging the size of the old (sized at Open for every row: later steps allocate
      // nothing), the old kept until the late transfer ends.
      const size_t capacity = q.staging.capacity, rows = q.staging.k_rows.capacity();
      abandoned_.push_back({std::move(q.staging), late, s.tables});
      q.staging = Staging();
      q.staging.k_rows.reserve(rows);
      q.staging.v_rows.reserve(rows);
      absl::Status bound = EnsureStaging(q.staging, capacity, /*exact=*/true);
      if (bound.ok()) bound = BindStaging(q);
      q.ticket = bound.ok() ? client_.GatherAsync(std::span<const ClientGatherItem>(&q.item, 1))
                            : std::make_shared<DoneTicket>(std::move(bound));
      q.shared = false;
    }
  }
}

void StoreKvCache::ReapAbandoned(bool wait) {
  std::erase_if(abandoned_, [wait](Abandoned& a) {
    if (wait) a.ticket->Wait(absl::InfiniteFuture()).IgnoreError();
    return a.ticket->Done();
  });
}

bool StoreKvCache::StartResident(SequenceId seq, Sequence& s, int layer, int64_t count,
                                 int64_t extra_rows) {
  if (resident_layers_ == nullptr || count != s.length[layer] ||
      !resident_layers_->Holds(seq, layer, count)) {
    return false;
  }
  Pending& p = s.pending[layer % 2];
  DropTicket(p);
  p.item.count = 0;
  p.item.slots.clear();  // (its capacity kept for the gathers of other layers)
  p.deferred = false;
  p.shared = false;
  p.resident = true;
  p.seq = seq;
  p.layer = layer;
  p.count = count;
  p.extra_rows = extra_rows;
  p.head_rows = 0;
  p.in_place = false;
  s.counters.bytes_full +=
      2 * static_cast<int64_t>(shape_.num_kv_heads) * count * static_cast<int64_t>(RowBytes());
  s.counters.fetches += 1;
  return true;
}

absl::StatusOr<KvLayerView> StoreKvCache::ReadAll(SequenceId seq, int layer) {
  IG_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  const int64_t n = s->Rows(layer);
  if (StartResident(seq, *s, layer, n, 0)) return FinishGather(*s, layer);
  // Packed (prefill attention reads contiguous rows); where the GPU reads the store's memory it
  // packs them itself (a chunked prefill reads every stored row back, each chunk: through host
  // staging and a copy that cost 6.5x the device's own gather on an H200).
  IG_RETURN_IF_ERROR(StartGather(seq, *s, layer, EverySlot(n), n, 0, /*in_place=*/device_gathers_));
  return FinishGather(*s, layer);
}

std::span<const int32_t> StoreKvCache::EverySlot(int64_t rows) {
  every_slot_.resize(static_cast<size_t>(shape_.num_kv_heads * rows));
  for (int g = 0; g < shape_.num_kv_heads; ++g) {
    for (int64_t j = 0; j < rows; ++j) every_slot_[g * rows + j] = static_cast<int32_t>(j);
  }
  return every_slot_;
}

absl::Status StoreKvCache::Prefetch(SequenceId seq, int layer, const int32_t* slots, int64_t count,
                                    int64_t extra_rows, bool placed) {
  IG_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
  if (layer < 0 || layer >= shape_.num_layers || count <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch of layer ", layer, ", ", count, " rows: out of range"));
  }
  // Every stored row, in slot order, of a layer kept on the device: copied there at the fetch.
  auto every_row = [&] {
    for (int64_t g = 0; g < shape_.num_kv_heads; ++g) {
      const int32_t* head = slots + g * count;
      for (int64_t j = 0; j < count; ++j) {
        if (head[j] != j) return false;
      }
    }
    return true;
  };
  if (resident_layers_ != nullptr && resident_layers_->Holds(seq, layer, count) &&
      count == s->length[layer] && every_row() &&
      StartResident(seq, *s, layer, count, extra_rows)) {
    return absl::OkStatus();
  }
  if (placed) {
    IG_ASSIGN_OR_RETURN(const bool reused, StartReuse(seq, *s, layer, slots, count, extra_rows));
    if (reused) return absl::OkStatus();
  }
  return StartGather(seq, *s, layer, std::span<const int32_t>(slots, shape_.num_kv_heads * count),
                     count, extra_rows, in_place_ || device_gathers_);
}

absl::StatusOr<KvLayerView> StoreKvCache::Fetch(SequenceId seq, int layer) {
  IG_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
  return FinishGather(*s, layer);
}

void StoreKvCache::RecordFetch(SequenceId seq, int layer, const int32_t* slots, int64_t count) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || layer < 0 || layer >= shape_.num_layers) return;
  // A KV pool's eviction statistics (a dense read, slots null, favours no row).
  if (it->second.pool != nullptr && slots != nullptr) it->second.pool->Fetched(layer, slots, count);
  const Pending& p = it->second.pending[layer % 2];
  if (p.layer != layer || !p.in_place || !host_access_) return;
  it->second.counters.bytes_fetched +=
      2 * static_cast<int64_t>(shape_.num_kv_heads) * count * static_cast<int64_t>(RowBytes());
}

FetchCounters StoreKvCache::Counters(SequenceId seq) const {
  auto it = sequences_.find(seq);
  return it == sequences_.end() ? FetchCounters{} : it->second.counters;
}

}  // namespace infinigen
