// StoreKvCache's rows planned on the device (StoreKvCacheOptions::plan_on_device; docs/worker.md,
// "Row reuse"): the row reuse of a GPU that gathers by block table, with its bookkeeping in
// backend memory (Backend::PlanKeptRows, MapKeptRows) instead of the host's ReusedRows, so that a
// decode step whose choices are made on the device prefetches, maps and attends them without the
// host reading them. The counts of what moved come back with the step's one wait
// (QueueDeviceCounts, SettleOnDevice).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/kv/store_kv_cache.h"

namespace infinigen {
namespace {

// Where each part of a sequence's Kept buffer starts (int32 entries).
struct KeptLayout {
  int64_t layers, heads, map_capacity, rows;
  int64_t row_of(int64_t l) const { return l * heads * map_capacity; }
  int64_t slot_of(int64_t l) const { return layers * heads * map_capacity + l * heads * rows; }
  int64_t moves(int parity) const {  // slots [heads, rows + 1], then rows [heads, rows + 1]
    return layers * heads * (map_capacity + rows) + parity * 2 * heads * (rows + 1);
  }
  int64_t workspace() const { return moves(2); }
  int64_t map_out() const { return workspace() + heads * rows; }
  int64_t miss_slots() const { return map_out() + heads * (rows + 1); }
  int64_t counts() const { return miss_slots() + heads * (rows + 1); }
  // Moved, missed and listed rows per layer and head, then the errors.
  int64_t moved(int64_t l) const { return counts() + l * heads; }
  int64_t missed(int64_t l) const { return counts() + (layers + l) * heads; }
  int64_t listed(int64_t l) const { return counts() + (2 * layers + l) * heads; }
  int64_t errors() const { return counts() + 3 * layers * heads; }
  int64_t count_entries() const { return 3 * layers * heads + 1; }
  int64_t total() const { return counts() + count_entries(); }
};

template <typename Kept>  // Sequence::Kept (private to StoreKvCache)
KeptLayout LayoutOf(const Kept& k) {
  return {k.layers, k.heads, k.map_capacity, k.rows};
}

}  // namespace

absl::Status StoreKvCache::OpenKept(Sequence& s, int64_t capacity_tokens) {
  if (!device_plans_ || s.reused == nullptr) {
    s.kept.reset();
    return absl::OkStatus();
  }
  const int64_t layers = shape_.num_layers - reuse_first_layer_;
  const KeptLayout at{layers, shape_.num_kv_heads, capacity_tokens + 1, s.reused->rows()};
  const size_t bytes = static_cast<size_t>(at.total()) * sizeof(int32_t);
  if (s.kept == nullptr) s.kept = std::make_unique<Sequence::Kept>();
  Sequence::Kept& k = *s.kept;
  if (k.buffer == nullptr || k.buffer->size() < bytes) {
    k.buffer.reset();
    IG_ASSIGN_OR_RETURN(k.buffer, backend_.Allocate(bytes));
  }
  k.layers = at.layers;
  k.heads = at.heads;
  k.map_capacity = at.map_capacity;
  k.rows = at.rows;
  k.counts.assign(static_cast<size_t>(at.count_entries()), 0);
  k.planned = k.queued = false;
  // TablesFor's items: every layer of every open sequence, their slot lists' room made now.
  const size_t items = static_cast<size_t>(shape_.num_layers) * sequences_.size();
  if (table_items_.size() < items) table_items_.resize(items);
  for (ClientGatherItem& item : table_items_) item.slots.reserve(shape_.num_kv_heads);
  // Nothing kept: the maps all -1, the counts 0 (copies when it opens, not in a decode step).
  const std::vector<int32_t> none(static_cast<size_t>(at.moves(0)), -1);
  int32_t* base = static_cast<int32_t*>(k.buffer->data());
  IG_RETURN_IF_ERROR(backend_.CopyToDevice(none.data(), base, none.size() * sizeof(int32_t)));
  return backend_.CopyToDevice(k.counts.data(), base + at.counts(),
                               k.counts.size() * sizeof(int32_t));
}

absl::Status StoreKvCache::ForgetKept(Sequence& s, int layer) {
  const Sequence::Kept& k = *s.kept;
  const KeptLayout at = LayoutOf(k);
  const int64_t l = layer - reuse_first_layer_;
  int32_t* base = static_cast<int32_t*>(k.buffer->data());
  const std::vector<int32_t> none(static_cast<size_t>(at.heads * std::max(k.map_capacity, k.rows)),
                                  -1);
  IG_RETURN_IF_ERROR(backend_.CopyToDevice(none.data(), base + at.row_of(l),
                                           at.heads * k.map_capacity * sizeof(int32_t)));
  return backend_.CopyToDevice(none.data(), base + at.slot_of(l),
                               at.heads * k.rows * sizeof(int32_t));
}

KeptRows StoreKvCache::KeptOf(Sequence& s, int layer) const {
  const Sequence::Kept& k = *s.kept;
  const KeptLayout at = LayoutOf(k);
  const int64_t l = layer - reuse_first_layer_;
  int32_t* base = static_cast<int32_t*>(k.buffer->data());
  return {shape_.num_kv_heads, base + at.row_of(l), k.map_capacity, base + at.slot_of(l), k.rows};
}

bool StoreKvCache::PlansOnDevice(SequenceId seq, int layer, int64_t max_list) const {
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || layer < reuse_first_layer_ || layer >= shape_.num_layers) {
    return false;
  }
  const Sequence& s = it->second;
  // Within the maps: the stored rows and the current token's slot.
  return s.kept != nullptr && s.reuse_buffer != nullptr && s.tables != nullptr &&
         s.tables->on_device() && s.Rows(layer) + 1 <= s.kept->map_capacity &&
         max_list <= s.kept->rows;
}

absl::Status StoreKvCache::PrefetchOnDevice(SequenceId seq, int layer, const DeviceSlotList& list) {
  IG_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
  if (!PlansOnDevice(seq, layer, list.max_count)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " of sequence ", seq,
                                                   " is not planned on the device for ",
                                                   list.max_count, " rows"));
  }
  Sequence::Kept& k = *s->kept;
  if (list.capacity > k.rows + 1 || list.max_count > k.rows) {
    return absl::InvalidArgumentError(absl::StrCat("a device prefetch of ", list.max_count,
                                                   " rows, more than the ", k.rows, " kept"));
  }
  Pending& p = s->pending[layer % 2];
  DropTicket(p);  // a host gather of this parity ends first (its staging is not ours)
  IG_RETURN_IF_ERROR(TablesFor(seq, *s, layer, s->Rows(layer)));
  const KeptLayout at = LayoutOf(k);
  int32_t* base = static_cast<int32_t*>(k.buffer->data());
  const int64_t l = layer - reuse_first_layer_;
  KeptRowsPlan plan;
  plan.kept = KeptOf(*s, layer);
  plan.list = list;
  plan.move_slots = base + at.moves(layer % 2);
  plan.move_rows = plan.move_slots + at.heads * (k.rows + 1);
  plan.move_counts = base + at.moved(l);
  plan.listed = base + at.listed(l);
  plan.workspace = base + at.workspace();
  plan.errors = base + at.errors();
  // The side batch first: a join that fails leaves no plan recorded whose rows never moved.
  IG_RETURN_IF_ERROR(SideBatchFor(layer).status());
  // On the side queue with the gather it plans (after the choice it reads: the fork follows
  // it), so that neither holds up the layer the main queue is computing. The kept rows it
  // changes are read there only after FetchOnDevice's join.
  IG_RETURN_IF_ERROR(backend_.ForkSideQueue());
  plan.on_side_queue = true;
  IG_RETURN_IF_ERROR(backend_.PlanKeptRows(plan));
  BlockRowsGather g;
  g.batch = 1;
  g.num_kv_heads = shape_.num_kv_heads;
  g.slots = plan.move_slots;
  g.slot_capacity = std::max<int64_t>(list.capacity, 1);
  g.list_counts = plan.move_counts;
  g.max_count = std::min(list.max_count, k.rows);
  g.dst_rows = plan.move_rows;
  g.dst_rows_per_list = k.rows;
  g.errors = plan.errors;
  g.on_side_queue = true;  // forked after the plan: the rows cross while the layer before runs
  p.layer = -1;
  if (absl::Status st = GatherKAndV(*s, layer, g, ReusedK(*s, layer), ReusedV(*s, layer));
      !st.ok()) {
    backend_.JoinSideQueue().IgnoreError();
    ForgetKept(*s, layer).IgnoreError();  // the plan holds rows that never came
    return st;
  }
  p.layer = layer;
  p.reuse = p.unsettled = false;
  p.resident = p.in_place = false;
  p.launched = true;
  p.side_batch = side_batches_;
  p.count = list.max_count;
  p.extra_rows = 1;
  p.seq = seq;
  if (!k.planned) planned_.push_back(seq);
  k.planned = true;
  const int64_t row = static_cast<int64_t>(RowBytes());
  s->counters.bytes_full += 2 * shape_.num_kv_heads * s->Rows(layer) * row;
  s->counters.fetches += 1;
  return absl::OkStatus();
}

absl::StatusOr<StreamedKvCache::DeviceRows> StoreKvCache::FetchOnDevice(
    SequenceId seq, int layer, const DeviceSlotList& choice, int64_t current_slot) {
  IG_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
  // (After the token's append: its slot, not the rows stored before it, must fit the maps.)
  if (layer < reuse_first_layer_ || layer >= shape_.num_layers || s->kept == nullptr ||
      s->reuse_buffer == nullptr || s->tables == nullptr || !s->tables->on_device() ||
      current_slot < 0 || current_slot >= s->kept->map_capacity) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " of sequence ", seq, " is not planned on the device"));
  }
  Sequence::Kept& k = *s->kept;
  if (choice.capacity > k.rows + 1) {
    return absl::InvalidArgumentError(absl::StrCat("a device choice of up to ", choice.capacity,
                                                   " rows, more than the ", k.rows + 1, " kept"));
  }
  Pending& p = s->pending[layer % 2];
  if (p.layer == layer && p.launched) {
    IG_RETURN_IF_ERROR(JoinSideQueue(p));
    p.launched = false;
  }
  // For the misses: the rows stored before this step's token (whose append waits for the step's
  // end).
  IG_RETURN_IF_ERROR(TablesFor(seq, *s, layer, std::min(current_slot, s->Rows(layer))));
  const KeptLayout at = LayoutOf(k);
  int32_t* base = static_cast<int32_t*>(k.buffer->data());
  const int64_t l = layer - reuse_first_layer_, heads = shape_.num_kv_heads;
  // The layer's K (and V) rows: [heads, rows] kept, a row per head for the current token, then
  // [heads, kMissRows] for the choice's rows not kept.
  KeptRowsMap map;
  map.kept = KeptOf(*s, layer);
  map.list = choice;
  map.head_rows = k.rows;
  map.current_slot = current_slot;
  map.current_row = heads * k.rows;
  map.miss_row = heads * k.rows + heads;
  map.miss_capacity = kMissRows;
  map.out = base + at.map_out();
  map.miss_slots = base + at.miss_slots();
  map.miss_counts = base + at.missed(l);
  map.errors = base + at.errors();
  IG_RETURN_IF_ERROR(backend_.MapKeptRows(map));
  if (!k.planned) planned_.push_back(seq);
  k.planned = true;
  BlockRowsGather g;
  g.batch = 1;
  g.num_kv_heads = shape_.num_kv_heads;
  g.slots = map.miss_slots;
  g.slot_capacity = std::max<int64_t>(choice.capacity, 1);
  g.list_counts = map.miss_counts;
  g.max_count = std::min(kMissRows, g.slot_capacity);
  g.dst_rows_per_list = kMissRows;
  g.errors = map.errors;
  const size_t miss_at = static_cast<size_t>(map.miss_row) * RowBytes();
  IG_RETURN_IF_ERROR(
      GatherKAndV(*s, layer, g, ReusedK(*s, layer) + miss_at, ReusedV(*s, layer) + miss_at));
  DeviceRows rows;
  rows.kv.num_slots = choice.max_count;
  rows.kv.k = shape_.HeadMajor(ReusedK(*s, layer), k.rows);
  rows.kv.v = shape_.HeadMajor(ReusedV(*s, layer), k.rows);
  rows.indices = map.out;
  return rows;
}

absl::Status StoreKvCache::QueueDeviceCounts() {
  // Every gather that adds to the counts is done first (a chunk that failed after its prefetch
  // never joined its side gathers; the logits' wait covers the backend's own queue only).
  if (side_joined_ < side_batches_) {
    IG_RETURN_IF_ERROR(backend_.JoinSideQueue());
    side_joined_ = side_batches_;
  }
  for (SequenceId seq : planned_) {
    auto it = sequences_.find(seq);
    if (it == sequences_.end() || it->second.kept == nullptr) continue;
    Sequence::Kept& k = *it->second.kept;
    const KeptLayout at = LayoutOf(k);
    const int32_t* counts = static_cast<const int32_t*>(k.buffer->data()) + at.counts();
    IG_RETURN_IF_ERROR(
        backend_.CopyToHostLater(counts, k.counts.data(), k.counts.size() * sizeof(int32_t)));
    k.queued = true;
  }
  counts_copy_ = backend_.host_copies_done();
  return absl::OkStatus();
}

absl::Status StoreKvCache::SettleOnDevice(SequenceId seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || it->second.kept == nullptr || !it->second.kept->planned) {
    return absl::OkStatus();
  }
  Sequence& s = it->second;
  Sequence::Kept& k = *s.kept;
  k.planned = false;
  planned_.erase(std::remove(planned_.begin(), planned_.end(), seq), planned_.end());
  if (!k.queued) return absl::OkStatus();  // the step failed before its counts were asked for
  k.queued = false;
  // The counts arrive at the backend's first wait after their copy: the logits', or (a step
  // that failed after its last layer) this one.
  if (backend_.host_copies_done() == counts_copy_) IG_RETURN_IF_ERROR(backend_.Synchronize());
  // The rows that crossed the link (each plan's moves and each choice's misses), and those a
  // plan found kept (listed, not moved).
  const KeptLayout at = LayoutOf(k);
  const int64_t lh = at.layers * at.heads;
  int64_t moved = 0, reused = 0;
  for (int64_t i = 0; i < lh; ++i) {
    const int64_t plan_moves = std::max(k.counts[i], 0);
    moved += plan_moves + std::max(k.counts[lh + i], 0);
    reused += std::max<int64_t>(k.counts[2 * lh + i] - plan_moves, 0);
  }
  const int64_t row = static_cast<int64_t>(RowBytes());
  s.counters.bytes_fetched += 2 * moved * row;
  s.counters.bytes_reused += 2 * reused * row;
  const int32_t errors = k.counts[3 * lh];
  // Next step's counts start from zero (an enqueued copy: no wait).
  std::fill(k.counts.begin(), k.counts.end(), 0);
  IG_RETURN_IF_ERROR(backend_.CopyToDevice(k.counts.data(),
                                           static_cast<int32_t*>(k.buffer->data()) + at.counts(),
                                           k.counts.size() * sizeof(int32_t)));
  if (errors > 0) {
    // A list past the rows kept, a choice with more than kMissRows rows not kept, or a row
    // outside the store's tables: some attention read a wrong row, and the layers after it
    // computed their K/V from it. Its held appends go nowhere (the step is void: the length of
    // each layer back to where it was), and every layer's rows start anew.
    for (auto l = later_appends_.begin(); l != later_appends_.end();) {
      if (l->seq != seq) {
        ++l;
        continue;
      }
      s.length[l->layer] = std::min(s.length[l->layer], l->start);
      s.answered[l->layer] = std::min(s.answered[l->layer], s.length[l->layer]);
      s.sent[l->layer] = std::min(s.sent[l->layer], s.length[l->layer]);
      l = later_appends_.erase(l);
    }
    for (int layer = reuse_first_layer_; layer < shape_.num_layers; ++layer) {
      IG_RETURN_IF_ERROR(ForgetKept(s, layer));
    }
    return absl::InternalError(
        absl::StrCat("the rows planned on the device for sequence ", seq, " did not fit (", errors,
                     " errors): its step is void; a retry moves every row again"));
  }
  return absl::OkStatus();
}

}  // namespace infinigen
