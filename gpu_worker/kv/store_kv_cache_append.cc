// StoreKvCache's appends: a layer's new rows placed in the sequence's slots, packed on a device
// and handed to the store's client (write-behind), item by item or held for a whole step.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/kv/store_kv_cache.h"

namespace infinigen {

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

}  // namespace infinigen
