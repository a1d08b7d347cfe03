#include "gpu_worker/kv/store_kv_cache.h"

#include <algorithm>

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

}  // namespace infinigen
