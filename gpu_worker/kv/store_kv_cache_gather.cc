// StoreKvCache's reads: a layer's chosen (or every) row gathered from the store into staging, or
// read in place, or copied inside the device for a layer kept there; the batch's prefetches
// submitted together, waited for, and gathered again alone when a shared gather was late.
#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/kv/store_kv_cache.h"

namespace infinigen {

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
