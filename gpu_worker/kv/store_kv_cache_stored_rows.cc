// StoreKvCache's steps planned on the device with a prompt chunk in them (docs/worker.md,
// "Rows planned on the device"): the chunk's rows stored before it read as stored, in staging
// laid out with room for its own after each head's (ReadsStored, PrefetchStored, ReadStored:
// its own rows come from the activations), and every layer's appends of the step held in
// backend memory until its end (BeginAppendStep), so that nothing waits between layers.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/kv/store_kv_cache.h"

namespace infinigen {

bool StoreKvCache::ReadsStored(SequenceId seq) const {
  auto it = sequences_.find(seq);
  // Gathered by block table into staging laid out as asked (a KV pool's slots are not
  // positions: its prefill reads back what it placed).
  return it != sequences_.end() && device_gathers_ && !host_access_ && it->second.pool == nullptr &&
         it->second.tables != nullptr && it->second.tables->on_device();
}

absl::StatusOr<StoreKvCache::Sequence*> StoreKvCache::StoredRowsOf(SequenceId seq, int layer,
                                                                   int64_t rows, int64_t room) {
  IG_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
  // (Nothing stored before it: its staging alone, whatever the sequence.)
  if ((rows > 0 && !ReadsStored(seq)) || layer < 0 || layer >= shape_.num_layers || rows < 0 ||
      room < 0 || rows > s->Rows(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("rows [0, ", rows, ") of layer ", layer,
                                                   " of sequence ", seq,
                                                   " cannot be read as stored"));
  }
  return s;
}

absl::Status StoreKvCache::PrefetchStored(SequenceId seq, int layer, int64_t rows, int64_t room) {
  IG_ASSIGN_OR_RETURN(Sequence * s, StoredRowsOf(seq, layer, rows, room));
  if (rows == 0) return absl::OkStatus();  // nothing to move
  // A dense layer kept on the device is copied there at the read.
  if (resident_layers_ != nullptr && resident_layers_->Holds(seq, layer, rows)) {
    return absl::OkStatus();
  }
  IG_RETURN_IF_ERROR(StartGather(seq, *s, layer, EverySlot(rows), rows, room, /*in_place=*/true));
  s->pending[layer % 2].head_rows = rows + room;  // before SubmitPrefetches launches it
  return absl::OkStatus();
}

absl::StatusOr<KvLayerView> StoreKvCache::ReadStored(SequenceId seq, int layer, int64_t rows,
                                                     int64_t room) {
  IG_ASSIGN_OR_RETURN(Sequence * s, StoredRowsOf(seq, layer, rows, room));
  const int64_t heads = shape_.num_kv_heads, per_head = rows + room;
  Pending& p = s->pending[layer % 2];  // (a prompt chunk's sequence prefetches nothing)
  if (rows == 0 || (resident_layers_ != nullptr && resident_layers_->Holds(seq, layer, rows))) {
    // Nothing stored, or a copy inside the device of the rows before the chunk.
    DropTicket(p);
    IG_RETURN_IF_ERROR(
        EnsureStaging(p.staging, static_cast<size_t>(heads * per_head) * RowBytes()));
    if (rows > 0) {
      IG_RETURN_IF_ERROR(resident_layers_->Read(seq, layer, rows, p.staging.k->data(),
                                                p.staging.v->data(), per_head));
    }
    s->counters.bytes_full += 2 * heads * s->Rows(layer) * static_cast<int64_t>(RowBytes());
    s->counters.fetches += 1;
  } else {
    // Prefetched during the layer before (PrefetchStored), or gathered now.
    if (p.layer != layer || p.resident || p.count != rows || p.head_rows != per_head) {
      IG_RETURN_IF_ERROR(
          StartGather(seq, *s, layer, EverySlot(rows), rows, room, /*in_place=*/true));
      p.head_rows = per_head;
    }
    IG_RETURN_IF_ERROR(FinishGather(*s, layer).status());
  }
  KvLayerView view;
  view.num_slots = per_head;
  view.k = shape_.HeadMajor(p.staging.k->data(), per_head);
  view.v = shape_.HeadMajor(p.staging.v->data(), per_head);
  return view;
}

namespace {

// Every layer's K and V rows of `tokens` tokens.
size_t StepAppendBytes(const KvCacheShape& shape, int64_t tokens) {
  return static_cast<size_t>(shape.num_layers) * 2 *
         static_cast<size_t>(std::max<int64_t>(tokens, 0)) * shape.num_kv_heads *
         static_cast<size_t>(shape.head_dim) * DTypeSize(shape.dtype);
}

}  // namespace

size_t StoreKvCache::HeldAppendBytes(const KvCacheShape& shape, int64_t tokens) {
  const size_t bytes = StepAppendBytes(shape, tokens);
  return bytes + bytes / 2;  // BeginAppendStep grows its room by half at least
}

bool StoreKvCache::BeginAppendStep(int64_t tokens, std::span<const SequenceId> decodes) {
  // The last step's decodes are no longer this one's (a step that failed early ended none).
  for (SequenceId seq : step_decodes_) {
    if (auto it = sequences_.find(seq); it != sequences_.end()) it->second.device_decode = false;
  }
  step_decodes_.clear();
  along_refused_ = false;
  if (host_access_) return false;  // host backends append item by item, now
  const size_t bytes = StepAppendBytes(shape_, tokens);
  // Every layer's rows at once: nothing may move while earlier layers' copies are queued.
  if (copy_queued_) return false;  // an earlier step's, not ended
  if (pack_ == nullptr || pack_->size() < bytes) {
    // By half at least: a batch that grows a sequence at a time reallocates rarely.
    const size_t old = pack_ == nullptr ? 0 : pack_->size();
    pack_.reset();
    absl::StatusOr<std::unique_ptr<Buffer>> grown =
        backend_.Allocate(std::max({bytes, old + old / 2, size_t{64}}));
    if (!grown.ok()) return false;  // the appends go layer by layer
    pack_ = *std::move(grown);
  }
  if (both_.size() < bytes) both_.resize(std::max(bytes, both_.size() + both_.size() / 2));
  step_appends_ = true;
  step_offset_ = 0;
  for (SequenceId seq : decodes) {
    auto it = sequences_.find(seq);
    if (it == sequences_.end()) continue;
    it->second.device_decode = true;
    step_decodes_.push_back(seq);  // (its room kept)
  }
  return true;
}

}  // namespace infinigen
