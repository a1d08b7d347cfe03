// StoreKvCache's row reuse (StoreKvCacheOptions::reuse_rows; docs/worker.md, "Row reuse"):
// where the GPU gathers by block table, each sequence keeps the rows of its last prefetch of
// every layer in a device buffer (ReusedRows says which row holds which slot), a placed
// prefetch asks the store for the block tables of its misses only and gathers just those into
// the rows the last prefetch held that this one does not list, and the fetch answers the
// layer's buffer, where StreamedKvCache::Placement finds each listed row.
#include <algorithm>
#include <cstring>

#include "common/status_macros.h"
#include "gpu_worker/kv/store_kv_cache.h"

namespace infinigen {

int64_t StoreKvCache::ReuseRows(int64_t capacity_tokens) const {
  // Where the GPU gathers by block table, or the backend is host memory and a transport copies
  // the rows (gRPC, UCX: a CPU worker beside a store elsewhere), not where rows are read in the
  // store's memory (nothing moves) nor where a GPU's rows are copied (not built).
  const bool moves_rows = device_gathers_ || (host_access_ && !in_place_);
  if (!moves_rows || options_.pool || !options_.reuse_rows ||
      reuse_first_layer_ >= shape_.num_layers) {
    return 0;
  }
  const int64_t capacity = std::max<int64_t>(capacity_tokens, 0);
  return std::clamp<int64_t>(options_.reuse_rows(capacity), 0, capacity + 1);
}

size_t StoreKvCache::ReuseBufferBytes(int64_t rows) const {
  if (rows <= 0) return 0;
  return static_cast<size_t>(shape_.num_layers - reuse_first_layer_) * 2 * shape_.num_kv_heads *
         static_cast<size_t>(rows + 1 + MissRows()) * RowBytes();
}

uint8_t* StoreKvCache::ReusedK(Sequence& s, int layer) const {
  const size_t one = static_cast<size_t>(shape_.num_kv_heads) *
                     static_cast<size_t>(s.reused->rows() + 1 + MissRows()) * RowBytes();
  return static_cast<uint8_t*>(s.reuse_buffer->data()) +
         static_cast<size_t>(2 * (layer - reuse_first_layer_)) * one;
}

uint8_t* StoreKvCache::ReusedV(Sequence& s, int layer) const {
  return ReusedK(s, layer) + static_cast<size_t>(shape_.num_kv_heads) *
                                 (s.reused->rows() + 1 + MissRows()) * RowBytes();
}

absl::Status StoreKvCache::OpenReuse(Sequence& s, int64_t capacity_tokens) {
  const int64_t rows = ReuseRows(capacity_tokens);
  if (rows == 0) {
    s.reused.reset();
    s.reuse_buffer.reset();
    s.kept.reset();
    return absl::OkStatus();
  }
  if (s.reused == nullptr || s.reused->rows() != rows) {
    s.reused = std::make_unique<ReusedRows>(shape_.num_layers, shape_.num_kv_heads, rows);
  } else {
    s.reused->ForgetAll();
  }
  // An ended sequence's buffer of this size if there is one (as staging: a batch that grows
  // again allocates nothing, and a GPU frees nothing, which would wait for the device).
  const size_t bytes = ReuseBufferBytes(rows);
  if (s.reuse_buffer != nullptr && s.reuse_buffer->size() != bytes) s.reuse_buffer.reset();
  if (s.reuse_buffer == nullptr) {
    auto spare = std::find_if(spare_reuse_.begin(), spare_reuse_.end(),
                              [&](const std::unique_ptr<Buffer>& b) { return b->size() == bytes; });
    if (spare != spare_reuse_.end()) {
      spare_bytes_ -= bytes;
      s.reuse_buffer = std::move(*spare);
      spare_reuse_.erase(spare);
    }
  }
  if (s.reuse_buffer == nullptr) {
    IG_ASSIGN_OR_RETURN(s.reuse_buffer, backend_.Allocate(bytes));
  }
  IG_RETURN_IF_ERROR(OpenKept(s, capacity_tokens));
  const size_t heads = static_cast<size_t>(shape_.num_kv_heads);
  const size_t moves = heads * static_cast<size_t>(2 * rows + 1);
  for (Pending& p : s.pending) {
    p.plan.positions.reserve(heads * static_cast<size_t>(rows));
    p.plan.moves.reserve(moves);
    if (p.device_slots == nullptr || p.device_slots->size() < moves * sizeof(int32_t)) {
      p.device_slots.reset();
      IG_ASSIGN_OR_RETURN(p.device_slots, backend_.Allocate(moves * sizeof(int32_t)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> StoreKvCache::StartReuse(SequenceId seq, Sequence& s, int layer,
                                              const int32_t* slots, int64_t count,
                                              int64_t extra_rows) {
  // (Rows planned on the device are not the host's to place: its prefetches gather apart.)
  if (s.reused == nullptr || s.reuse_buffer == nullptr || s.kept != nullptr ||
      layer < reuse_first_layer_ || extra_rows > 1) {
    return false;
  }
  Pending& p = s.pending[layer % 2];
  DropTicket(p);
  if (!s.reused->Place(layer, slots, count, p.plan)) return false;
  p.reuse = p.unsettled = true;
  p.reused = s.reused.get();
  p.resident = false;
  p.in_place = device_gathers_;  // else the transport copies the misses into staging
  p.seq = seq;
  p.count = count;
  p.extra_rows = extra_rows;
  p.shared = false;
  // The store is asked for the misses alone (it checks them, and answers the layer's block
  // tables, or copies them): head g's, then its last one again up to the most of one head (or,
  // for a head with none, its first listed slot), which are not placed (the counts stop
  // before).
  const int64_t heads = shape_.num_kv_heads, most = p.plan.most_misses;
  const int32_t* miss = p.plan.miss_slots();
  const int32_t* misses = p.plan.miss_counts(shape_.num_kv_heads);
  p.item.seq = StoreId(seq);
  p.item.layer = layer;
  p.item.count = most;
  p.item.slots.resize(static_cast<size_t>(heads * most));
  for (int64_t g = 0; g < heads; ++g) {
    const int64_t n = misses[g];
    for (int64_t m = 0; m < most; ++m) {
      p.item.slots[g * most + m] = m < n   ? miss[g * count + m]
                                   : n > 0 ? miss[g * count + n - 1]
                                           : slots[g * count];
    }
  }
  p.item.k_out = p.item.v_out = nullptr;
  p.item.k_rows = p.item.v_rows = nullptr;
  p.item.block_table = BlockTableOut{};
  if (most > 0) {
    // By block table (the GPU reads the arena), or copied packed into staging ([num_kv_heads,
    // most], placed at the fetch).
    absl::Status st = device_gathers_ ? ReserveTables(s, s.Rows(layer))
                                      : EnsureStaging(p.staging, heads * most * RowBytes());
    if (!st.ok()) {
      s.reused->Forget(layer);
      p.reuse = p.unsettled = false;
      return st;
    }
    if (device_gathers_) {
      p.item.block_table = s.tables->Out(layer);
    } else {
      p.item.k_out = static_cast<uint8_t*>(p.staging.k->data());
      p.item.v_out = static_cast<uint8_t*>(p.staging.v->data());
    }
    if (deferring_) {
      p.deferred = true;
      deferred_.emplace_back(seq, layer % 2);
    } else {
      p.ticket = client_.GatherAsync(std::span<const ClientGatherItem>(&p.item, 1));
    }
  }
  p.layer = layer;
  const int64_t row = static_cast<int64_t>(RowBytes());
  // What crosses: the misses (the device reads only them), or every head's `most` rows (the
  // transport copies the padding too).
  s.counters.bytes_fetched += 2 * (device_gathers_ ? p.plan.misses : heads * most) * row;
  s.counters.bytes_reused += 2 * (heads * count - p.plan.misses) * row;
  s.counters.bytes_full += 2 * heads * s.Rows(layer) * row;
  s.counters.fetches += 1;
  return true;
}

absl::StatusOr<KvLayerView> StoreKvCache::FinishReuse(Sequence& s, Pending& p) {
  if (p.deferred) SubmitPrefetches();
  if (p.ticket != nullptr) {
    if (absl::Status st = WaitGather(s, p); !st.ok()) {
      DropTicket(p);  // (forgets the layer's rows)
      return st;
    }
    p.ticket.reset();
    absl::Status moved;
    if (p.launched) {  // on the side queue since SubmitPrefetches
      moved = JoinSideQueue(p);
      p.launched = false;
    } else if (device_gathers_) {
      moved = GatherOnDevice(s, p);
    } else {
      PlaceCopiedMisses(s, p);
    }
    if (!moved.ok()) {  // nothing of this prefetch may be read: a second Fetch fails too
      s.reused->Forget(p.layer);
      p.reuse = p.unsettled = false;
      p.layer = -1;
      return moved;
    }
  }
  p.unsettled = false;
  KvLayerView view;
  view.num_slots = p.count;
  view.k = shape_.HeadMajor(ReusedK(s, p.layer), s.reused->rows());
  view.v = shape_.HeadMajor(ReusedV(s, p.layer), s.reused->rows());
  return view;
}

void StoreKvCache::PlaceCopiedMisses(Sequence& s, Pending& p) {
  // Host memory both: each miss from its packed row into the row the plan freed for it.
  const int heads = shape_.num_kv_heads;
  const int64_t count = p.count, most = p.plan.most_misses, rows = s.reused->rows();
  const size_t rb = RowBytes();
  const int32_t* at = p.plan.miss_rows(heads);
  const int32_t* misses = p.plan.miss_counts(heads);
  const auto* k = static_cast<const uint8_t*>(p.staging.k->data());
  const auto* v = static_cast<const uint8_t*>(p.staging.v->data());
  uint8_t* rk = ReusedK(s, p.layer);
  uint8_t* rv = ReusedV(s, p.layer);
  for (int g = 0; g < heads; ++g) {
    for (int32_t m = 0; m < misses[g]; ++m) {
      const size_t from = static_cast<size_t>(g * most + m) * rb;
      const size_t to = static_cast<size_t>(g * rows + at[g * count + m]) * rb;
      std::memcpy(rk + to, k + from, rb);
      std::memcpy(rv + to, v + from, rb);
    }
  }
}

StreamedKvCache::RowPlacement StoreKvCache::Placement(SequenceId seq, int layer) const {
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || layer < 0) return {};
  const Pending& p = it->second.pending[layer % 2];
  if (p.layer != layer || !p.reuse) return {};
  return {p.plan.positions.data(), it->second.reused->rows()};
}

absl::Status StoreKvCache::GatherMissesOnDevice(Sequence& s, Pending& p, bool on_side_queue) {
  const int heads = shape_.num_kv_heads;
  const int64_t count = p.count, most = p.plan.most_misses;
  if (most == 0) return absl::OkStatus();
  // The plan's moves (slots, rows, counts) in one copy.
  const size_t bytes = p.plan.moves.size() * sizeof(int32_t);
  if (p.device_slots == nullptr || p.device_slots->size() < bytes) {
    p.device_slots.reset();
    IG_ASSIGN_OR_RETURN(p.device_slots, backend_.Allocate(bytes));
  }
  IG_RETURN_IF_ERROR(backend_.CopyToDevice(p.plan.moves.data(), p.device_slots->data(), bytes));
  const int32_t* moves = static_cast<const int32_t*>(p.device_slots->data());
  // Each KV head a list of its own (its own count): "batch" heads of one head each, whose
  // tables [2, heads, capacity] are then list after list.
  BlockRowsGather g;
  g.batch = heads;
  g.num_kv_heads = 1;
  g.slots = moves;
  g.slot_capacity = count;
  g.dst_rows = moves + heads * count;
  g.counts = moves + 2 * heads * count;
  g.max_count = most;
  g.dst_rows_per_list = s.reused->rows();
  g.on_side_queue = on_side_queue;
  return GatherKAndV(s, p.layer, g, ReusedK(s, p.layer), ReusedV(s, p.layer));
}

}  // namespace infinigen
