// StoreKvCache's gathers on a GPU that reads the store's memory (StoreKvCacheOptions::
// device_reads_mapped_rows): the arena registered with the backend, each sequence's block tables
// kept on the device (DeviceBlockTables), a prefetch's rows gathered by slot through
// Backend::GatherBlockRows, and a batch's gathers launched on the backend's side queue so that
// they cross the link while the layer before computes. Rows planned on the device are read by
// those tables without a gather of their own: the store is asked for them once a step, every
// sequence together (TablesFor).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/kv/store_kv_cache.h"

namespace infinigen {

absl::Status StoreKvCache::RegisterMapped() {
  const KvStoreClient::Span m = client_.mapped_memory();
  if (m.data == nullptr) return absl::FailedPreconditionError("the client maps no store memory");
  if (registered_ != nullptr && m.generation == registered_generation_) return absl::OkStatus();
  // A restarted store's arena, mapped anew (perhaps at the old one's address): the old one's
  // registration goes first (its pages stay pinned while registered, and the new mapping's
  // rows would be read from them). The backend forgets it even where the driver refuses to
  // let go of a range already unmapped (its pages then stay pinned: nothing else is wrong).
  if (registered_ != nullptr) {
    (void)backend_.UnregisterHostMemory(registered_);
    registered_ = nullptr;
  }
  IG_RETURN_IF_ERROR(backend_.RegisterHostMemory(m.data, m.bytes));
  registered_ = m.data;
  registered_generation_ = m.generation;
  rows_per_block_ =
      m.block_bytes >= RowBytes() ? static_cast<int64_t>(m.block_bytes / RowBytes()) : 0;
  return absl::OkStatus();
}

size_t StoreKvCache::GatherTableBytes(int64_t capacity_tokens) const {
  if (!device_gathers_) return 0;
  // Each layer in flight's slot list: every row, or row reuse's moves (ReusedRows::Plan).
  const size_t entries =
      static_cast<size_t>(shape_.num_kv_heads) *
      static_cast<size_t>(std::max(capacity_tokens + 1, 2 * ReuseRows(capacity_tokens) + 1));
  return 2 * entries * sizeof(int32_t) + TableBytes(capacity_tokens);
}

size_t StoreKvCache::TableBytes(int64_t capacity_tokens) const {
  if (!device_gathers_) return 0;
  return DeviceBlockTables::BytesFor(shape_.num_layers, shape_.num_kv_heads, rows_per_block_,
                                     capacity_tokens + 1);
}

absl::Status StoreKvCache::JoinSideQueue(const Pending& p) {
  if (!p.launched || p.side_batch <= side_joined_) return absl::OkStatus();
  // The join orders after it every side gather queued so far (later batches' too).
  const absl::Status st = backend_.JoinSideQueue();
  if (st.ok()) side_joined_ = side_batches_;
  return st;
}

absl::Status StoreKvCache::GatherOnDevice(Sequence& s, Pending& p, bool on_side_queue) {
  if (p.reuse) return GatherMissesOnDevice(s, p, on_side_queue);
  const int64_t heads = shape_.num_kv_heads;
  const size_t entries = static_cast<size_t>(heads * (p.count + p.extra_rows));
  IG_RETURN_IF_ERROR(EnsureStaging(p.staging, entries * RowBytes()));
  if (p.count == 0) return absl::OkStatus();
  const size_t slot_bytes = static_cast<size_t>(heads * p.count) * sizeof(int32_t);
  if (p.device_slots == nullptr || p.device_slots->size() < slot_bytes) {
    // Past the capacity, or read after Idle: room for every row the tables hold.
    const size_t rows = static_cast<size_t>(s.tables->capacity() * rows_per_block_) + 1;
    p.device_slots.reset();
    IG_ASSIGN_OR_RETURN(p.device_slots,
                        backend_.Allocate(std::max(slot_bytes, heads * rows * sizeof(int32_t))));
  }
  IG_RETURN_IF_ERROR(
      backend_.CopyToDevice(p.item.slots.data(), p.device_slots->data(), slot_bytes));
  BlockRowsGather g;
  g.batch = 1;
  g.num_kv_heads = shape_.num_kv_heads;
  g.slots = static_cast<const int32_t*>(p.device_slots->data());
  g.slot_capacity = p.count;
  g.max_count = p.count;
  g.dst_rows_per_list = p.head_rows > 0 ? p.head_rows : p.count;
  g.on_side_queue = on_side_queue;
  return GatherKAndV(s, p.layer, g, p.staging.k->data(), p.staging.v->data());
}

absl::Status StoreKvCache::GatherKAndV(Sequence& s, int layer, BlockRowsGather g, void* k,
                                       void* v) {
  IG_ASSIGN_OR_RETURN(const int32_t* tables, s.tables->OnDevice(backend_, layer));
  IG_RETURN_IF_ERROR(RegisterMapped());  // the arena mapped now (a restarted store's: anew)
  const KvStoreClient::Span arena = client_.mapped_memory();
  g.arena = arena.data;
  g.arena_bytes = arena.bytes;
  g.block_bytes = arena.block_bytes;
  g.rows_per_block = rows_per_block_;
  g.row_bytes = static_cast<int64_t>(RowBytes());
  g.table_capacity = s.tables->capacity();
  if (g.on_side_queue) IG_RETURN_IF_ERROR(backend_.ForkSideQueue());
  g.tables = tables;
  g.dst = k;
  IG_RETURN_IF_ERROR(backend_.GatherBlockRows(g));
  // The V tables follow the K tables ([2, heads, capacity]).
  g.tables = tables + shape_.num_kv_heads * s.tables->capacity();
  g.dst = v;
  return backend_.GatherBlockRows(g);
}

absl::Status StoreKvCache::ReserveTables(Sequence& s, int64_t rows) {
  if (s.tables->BlocksFor(rows) <= s.tables->capacity()) {
    // Idle since it was sized (KvCache::Idle gives its device copy back): made again.
    return s.tables->on_device() ? absl::OkStatus() : s.tables->Reserve(backend_, rows);
  }
  // Gathers of this sequence still to answer into the tables: sent and waited for, as a fetch
  // would (gathers abandoned late answer into the old tables, which stay).
  for (const Pending& q : s.pending) {
    if (q.deferred) SubmitPrefetches();
  }
  for (Pending& q : s.pending) {
    if (q.ticket == nullptr) continue;
    if (absl::Status st = q.ticket->Wait(absl::Now() + options_.fetch_timeout); !st.ok()) {
      if (absl::IsDeadlineExceeded(st)) return st;  // the sequence fails; its tables stay
    }
  }
  // ... and a late ask that answers into these tables (TablesFor's, asking for several
  // sequences, or RegatherAlone's): the tables are copied below while it could still write them.
  for (Abandoned& a : abandoned_) {
    if (a.tables != s.tables) continue;
    if (absl::Status st = a.ticket->Wait(absl::Now() + options_.fetch_timeout);
        absl::IsDeadlineExceeded(st)) {
      return st;  // the sequence fails; its tables stay
    }
  }
  const absl::Status st = s.tables->Reserve(backend_, rows, /*grow=*/true);
  for (Pending& q : s.pending) {  // a retry of either answers into the moved tables
    if (q.item.block_table.requested()) q.item.block_table = s.tables->Out(q.item.layer);
  }
  return st;
}

absl::StatusOr<int64_t> StoreKvCache::SideBatchFor(int layer) {
  // The gathers launched before (the layer about to be attended) are joined first, so that this
  // batch's (the next layer's) overlap the layer's attention and what follows it, not the other
  // way round; more gathers of the same layer join its open batch (a step planned on the device
  // launches its decodes' and its prompt chunks' apart).
  if (device_side_layer_ == layer && side_joined_ < side_batches_) return side_batches_;
  if (side_joined_ < side_batches_) {
    IG_RETURN_IF_ERROR(backend_.JoinSideQueue());
    side_joined_ = side_batches_;
  }
  device_side_layer_ = layer;
  if (layer >= 0 && layer < shape_.num_layers) side_batch_of_layer_[layer] = side_batches_ + 1;
  return ++side_batches_;
}

absl::Status StoreKvCache::JoinDevicePrefetches(int layer) {
  if (layer >= shape_.num_layers) return absl::OkStatus();
  const int64_t batch = layer < 0 ? side_batches_ : side_batch_of_layer_[layer];
  if (batch <= side_joined_) return absl::OkStatus();
  // (Later batches are ordered too: one join covers everything queued so far.)
  IG_RETURN_IF_ERROR(backend_.JoinSideQueue());
  side_joined_ = side_batches_;
  return absl::OkStatus();
}

void StoreKvCache::LaunchOnSideQueue(std::span<Pending* const> pendings) {
  // While they run, the next layer's appends reach the store: only the current token's slot is
  // written (in a KV pool, over a token it evicts), and a decode step attends to the current
  // token's own row for that slot, never to what was gathered there.
  if (pendings.empty()) return;
  absl::StatusOr<int64_t> opened = SideBatchFor(pendings.front()->layer);
  if (!opened.ok()) return;  // nothing launched: the fetches gather
  const int64_t batch = *opened;
  for (Pending* p : pendings) {
    // Only a gather the store has answered (its block tables, after the appends before it: the
    // in-process transport's at once); the others go at their fetch, which waits for them.
    if (p->ticket == nullptr || !p->ticket->Done() || !p->ticket->Wait(absl::Now()).ok()) continue;
    Sequence& s = sequences_.find(p->seq)->second;
    // A launch that fails leaves the gather to the fetch, which reports what fails there,
    // after a join (a part of it may be queued: the K rows, not the V rows).
    p->side_batch = batch;
    p->launched = GatherOnDevice(s, *p, /*on_side_queue=*/true).ok();
    if (!p->launched && backend_.JoinSideQueue().ok()) side_joined_ = side_batches_;
  }
}

bool StoreKvCache::AsksStore(const Sequence& s, int layer, int64_t rows) const {
  // A layer's rows are read from the arena without asking the store while its tables hold
  // their blocks and an answer has covered them: the appends of the step before (sent after
  // its logits, write-behind: over shm they linger on their way) have landed.
  return rows > 0 &&
         (s.answered[layer] < rows || s.tables->held_blocks(layer) < s.tables->BlocksFor(rows));
}

bool StoreKvCache::AsksAlongside(const Sequence& s, int layer) const {
  if (along_refused_ || !s.device_decode || s.kept == nullptr || s.reuse_buffer == nullptr ||
      s.tables == nullptr || !s.tables->on_device()) {
    return false;
  }
  const int64_t rows = s.sent[layer];
  // Not where its own gather of the layer answers into the same tables (held or in flight), nor
  // past the room its tables have (its own call reserves more).
  const Pending& p = s.pending[layer % 2];
  return !(p.layer == layer && (p.deferred || p.ticket != nullptr)) &&
         s.tables->BlocksFor(rows) <= s.tables->capacity() && AsksStore(s, layer, rows);
}

absl::Status StoreKvCache::TablesFor(SequenceId seq, Sequence& s, int layer, int64_t rows) {
  if (!abandoned_.empty()) ReapAbandoned(/*wait=*/false);  // (late asks that ended since)
  IG_RETURN_IF_ERROR(ReserveTables(s, rows + 1));
  if (!AsksStore(s, layer, rows)) return absl::OkStatus();
  // The store answers with a gather of each layer's last row (nothing is copied: only the
  // blocks a layer gained), after the appends queued before it. This layer, every later one of
  // this sequence, and the layers of every other sequence planned on the device whose rows sent
  // no answer has covered, in one call: one wait a step whatever the batch, at the first layer
  // planned on the device. (Rows sent, not stored: this step's are held until its end.)
  size_t n = 0;
  auto add = [&](SequenceId id, Sequence& q, int l, int64_t r) {
    if (n == table_items_.size()) table_items_.resize(n + shape_.num_layers);  // (opens size it)
    ClientGatherItem& item = table_items_[n++];
    item.seq = StoreId(id);
    item.layer = l;
    item.count = 1;
    item.slots.assign(static_cast<size_t>(shape_.num_kv_heads), static_cast<int32_t>(r - 1));
    item.block_table = q.tables->Out(l);
  };
  add(seq, s, layer, rows);
  for (int l = layer + 1; l < shape_.num_layers; ++l) {
    if (AsksStore(s, l, s.sent[l])) add(seq, s, l, s.sent[l]);
  }
  const size_t own = n;
  for (auto& [id, q] : sequences_) {
    if (&q == &s) continue;
    for (int l = reuse_first_layer_; l < shape_.num_layers; ++l) {
      if (AsksAlongside(q, l)) add(id, q, l, q.sent[l]);
    }
  }
  const absl::Time asked = absl::Now();
  std::shared_ptr<GatherTicket> ticket =
      client_.GatherAsync(std::span<const ClientGatherItem>(table_items_.data(), n));
  ++table_waits_;
  absl::Status st = ticket->Wait(asked + options_.fetch_timeout);
  if (!st.ok() && n > own && ticket->Done()) {
    // Refused (another sequence's, a sequence the store lost?): this one asks alone, and so do
    // the others for the rest of the step, so that one bad sequence fails only itself.
    along_refused_ = true;
    n = own;
    ticket = client_.GatherAsync(std::span<const ClientGatherItem>(table_items_.data(), n));
    ++table_waits_;
    st = ticket->Wait(absl::Now() + options_.fetch_timeout);
  }
  table_wait_seconds_ += absl::ToDoubleSeconds(absl::Now() - asked);
  if (!st.ok() && !ticket->Done()) {
    // Late: its answers may still land in the tables of every sequence it asked for, which stay
    // until it ends (a sequence closed meanwhile frees its own).
    for (size_t i = 0; i < n; ++i) {
      if (i > 0 && table_items_[i].seq == table_items_[i - 1].seq) continue;
      auto it = sequences_.find(table_items_[i].seq - options_.id_base);
      if (it != sequences_.end()) abandoned_.push_back({Staging(), ticket, it->second.tables});
    }
  }
  IG_RETURN_IF_ERROR(st);
  for (size_t i = 0; i < n; ++i) {
    const ClientGatherItem& item = table_items_[i];
    auto it = sequences_.find(item.seq - options_.id_base);
    if (it != sequences_.end()) it->second.answered[item.layer] = item.slots[0] + 1;
  }
  return absl::OkStatus();
}

}  // namespace infinigen
