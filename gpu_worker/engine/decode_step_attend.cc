// DecodeStep's attention of one layer (Attend): pass 1 stores the batch's new K/V and has the
// policies choose rows; pass 2 attends each chunk over the rows its cache holds (a prefill's
// causal attention, the rows prefetched during the previous layer mapped onto the choice, a
// fetch of the choice, or the resident cache).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/engine/step_timing.h"

namespace infinigen {

using step_timing::Clock;
using step_timing::ScopedTiming;
using step_timing::Since;

absl::Status DecodeStep::Attend(int layer, MatView q, MatView k, MatView v, MatView out) {
  const ModelConfig& c = model_.config();
  Backend& backend = model_.backend();
  const int64_t kv_heads = c.num_kv_heads;
  const std::span<const ForwardChunk> batch = batch_;
  const DType kv_dtype = model_.kv_shape().dtype;
  if (k.dtype != kv_dtype) {
    IG_RETURN_IF_ERROR(
        EnsureBuffer(current_kv_, batch.size() * 2 * kv_heads * c.head_dim * DTypeSize(kv_dtype)));
  }
  // Policies run on the host: they read this layer's queries and keys (and the speculated
  // queries) as host floats, copied out of the backend's memory where the host cannot read it.
  const bool host_memory = backend.host_accessible();
  bool host_policy = false;  // a policy choosing on the host reads them
  for (size_t b = 0; b < batch.size(); ++b) {
    host_policy = host_policy || (batch[b].policy != nullptr && !ChoosesOnBackend(b));
  }
  HostRows host_q, host_k, spec_q;
  std::optional<ScopedTiming> timing(Timing(&StepProfile::select));
  if (host_policy) {  // one copy (one wait) for all three
    const bool speculated = spec_layer_[layer % 2] == layer;
    const MatView views[] = {q, k, speculated ? SpeculatedRows(layer) : MatView()};
    HostRows* out[] = {&host_q, &host_k, &spec_q};
    IG_RETURN_IF_ERROR(ToHost({views, speculated ? 3u : 2u}, {out, speculated ? 3u : 2u}, host_q_));
  }

  // Pass 1: store every chunk's K/V, the batch's in one call (one copy out of a device).
  timing.emplace(Timing(&StepProfile::append));
  appends_.clear();
  append_chunks_.clear();
  for (size_t b = 0; b < batch.size(); ++b) {
    selections_[b].all = true;
    if (Failed(b)) continue;
    const ForwardChunk& chunk = batch[b];
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    const int64_t row = rows_[b];
    appends_.push_back({chunk.seq, chunk.start, k.Rows(row, len), v.Rows(row, len),
                        host_slots_.data() + row * kv_heads});
    append_chunks_.push_back(b);
  }
  append_status_.resize(appends_.size());
  // Their rows leave the device during the wait below (EndAppendLayer after it).
  cache_.BeginAppendLayer(layer, appends_, append_status_);
  for (size_t i = 0; i < append_chunks_.size(); ++i) {
    const size_t b = append_chunks_[i];
    const ForwardChunk& chunk = batch[b];
    ChunkWork& w = chunks_[b];
    if (!append_status_[i].ok()) {
      FailKv(b, layer, append_status_[i]);
      continue;
    }
    if (chunk.policy == nullptr) continue;
    w.kv = KvLayerView();  // the stored rows themselves only where the host can read them
    if (resident_ != nullptr && host_memory) {
      absl::StatusOr<KvLayerView> kv = resident_->Read(chunk.seq, layer);
      if (kv.ok()) w.kv = *kv;
      if (!kv.ok()) FailKv(b, layer, kv.status());
    } else {
      absl::StatusOr<int64_t> stored = cache_.NumSlots(chunk.seq, layer);
      if (stored.ok()) w.kv.num_slots = *stored;
      if (!stored.ok()) FailKv(b, layer, stored.status());
    }
  }

  // The policies see the keys and choose the rows of each decode token, sequences in parallel.
  timing.emplace(Timing(&StepProfile::select));
  ForEachPolicy([&](size_t b) -> absl::Status {
    if (ChoosesOnBackend(b)) return absl::OkStatus();  // below
    const ForwardChunk& chunk = batch[b];
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    KvSelectionPolicy* policy = chunk.policy;
    const ChunkWork& w = chunks_[b];
    const int64_t row = rows_[b];
    const int32_t* slots = host_slots_.data() + row * kv_heads;
    LayerKeys keys{chunk.seq,     layer,           chunk.start,   len,   host_k.Row(row),
                   host_k.stride, host_q.Row(row), host_q.stride, slots, w.kv};
    IG_RETURN_IF_ERROR(policy->OnKeys(keys));
    if (len != 1) return absl::OkStatus();
    SelectRequest request;
    request.seq = chunk.seq;
    request.layer = layer;
    request.position = chunk.start;
    request.current_slots = slots;
    request.kv = w.kv;
    request.q = host_q.Row(row);
    if (spec_layer_[layer % 2] == layer && spec_rows_[b] >= 0) {
      request.speculated_q = spec_q.Row(spec_rows_[b]);
    }
    Selection& selection = selections_[b];
    IG_RETURN_IF_ERROR(policy->Select(request, selection));
    if (!selection.all && (selection.count <= 0 || static_cast<int64_t>(selection.indices.size()) !=
                                                       selection.count * kv_heads)) {
      return absl::InternalError(
          absl::StrCat("policy ", policy->Name(), " returned a malformed selection"));
    }
    return absl::OkStatus();
  });
  // The policies that choose in backend memory: the new keys (every chunk), then the choices of
  // the decode tokens.
  select_.chunks.clear();
  for (size_t b = 0; b < batch.size(); ++b) {
    if (Failed(b) || !ChoosesOnBackend(b)) continue;
    const ForwardChunk& chunk = batch[b];
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    const int32_t* slots = host_slots_.data() + rows_[b] * kv_heads;
    bool positions = true;  // the partial keys are kept by position
    for (int64_t i = 0; i < len * kv_heads && positions; ++i) {
      positions = slots[i] == chunk.start + i / kv_heads;
    }
    absl::Status st =
        positions
            ? chunk.policy->OnBackendKeys(chunk.seq, layer, k.Rows(rows_[b], len), chunk.start)
            : absl::FailedPreconditionError(absl::StrCat(
                  "policy ", chunk.policy->Name(),
                  " chooses on the backend and needs a KV cache whose slots are positions"));
    if (!st.ok()) {
      Fail(b, std::move(st));
      continue;
    }
    if (len != 1) continue;
    select_.chunks.push_back(b);
    select_.rows[b] = chunks_[b].kv.num_slots;
  }
  IG_RETURN_IF_ERROR(LaunchChoices(select_, layer, /*prefetch=*/false));
  // Over a streamed cache, the next layer's prefetch: its choices launched too (speculated
  // during BeforeLayer), so that one wait brings this layer's new K/V rows off the device, its
  // choices and the next layer's (the target is no wait; this was three per layer).
  const bool prefetch_next = streamed_ != nullptr && layer + 1 < c.num_layers;
  timing.reset();  // the prefetch's halves time their own phases
  if (prefetch_next) IG_RETURN_IF_ERROR(PrefetchBegin(layer + 1));
  timing.emplace(Timing(&StepProfile::select));
  if (select_.launched || (prefetch_next && preselect_.launched)) {
    IG_RETURN_IF_ERROR(backend.Synchronize());
  }
  select_.launched = preselect_.launched = false;  // their copies are done
  if (!device_plan_) {
    cache_.EndAppendLayer();  // (waits itself where nothing above did)
    CollectChoices(select_, [&](size_t b) -> Selection& { return selections_[b]; });
  }
  timing.reset();
  if (prefetch_next) IG_RETURN_IF_ERROR(PrefetchEnd(layer + 1));

  // A streamed cache starts fetching what the prefetch during the previous layer did not
  // bring, so that the fetches of later sequences overlap the attention of earlier ones in
  // pass 2.
  timing.emplace(Timing(&StepProfile::prefetch));
  for (size_t b = 0; b < batch.size() && streamed_ != nullptr; ++b) {
    const ForwardChunk& chunk = batch[b];
    const Selection& selection = selections_[b];
    const int32_t* slots = host_slots_.data() + rows_[b] * kv_heads;
    const Prefetched& pre = prefetched_[layer % 2][b];
    if (chunk.tokens.size() != 1 || Failed(b) || (pre.layer == layer && pre.on_device) ||
        (device_plan_ && select_.result[b] == BackendChoiceResult::kLaunched) ||
        MapPrefetched(b, layer, selection, slots)) {
      continue;  // (planned on the device: pass 2 maps it there)
    }
    // Nothing prefetched, or the selection left the candidates: fetch exactly it now.
    absl::Status st;
    if (selection.all) {  // dense: every stored row
      absl::StatusOr<int64_t> stored = cache_.NumSlots(chunk.seq, layer);
      if (stored.ok()) {
        EverySlot(kv_heads, *stored, all_slots_);
        st = streamed_->Prefetch(chunk.seq, layer, all_slots_.data(), *stored);
      } else {
        st = stored.status();
      }
    } else {
      st = streamed_->Prefetch(chunk.seq, layer, selection.indices.data(), selection.count);
    }
    if (!st.ok()) FailKv(b, layer, st);
  }

  // Every decode token's row indices into its rows (the prefetched rows mapped onto its
  // selection, or the selection itself over a resident cache), the batch's in one copy.
  index_at_.assign(batch.size(), -1);
  host_indices_.clear();
  // Room for every row of every decode token, twice (as ReserveRowLists: a warmed-up step
  // allocates nothing while its sequences grow a row a step).
  size_t most = 0;
  for (const ForwardChunk& chunk : batch) {
    if (chunk.tokens.size() == 1) most += static_cast<size_t>(kv_heads * (chunk.start + 1));
  }
  if (host_indices_.capacity() < most) host_indices_.reserve(2 * most);
  for (size_t b = 0; b < batch.size(); ++b) {
    if (batch[b].tokens.size() != 1 || Failed(b)) continue;
    const std::vector<int32_t>* list = nullptr;
    if (streamed_ != nullptr && prefetched_[layer % 2][b].layer == layer &&
        prefetched_[layer % 2][b].on_device) {
      continue;
    } else if (streamed_ != nullptr && prefetched_[layer % 2][b].layer == layer) {
      list = &prefetched_[layer % 2][b].map;
    } else if (resident_ != nullptr && !selections_[b].all) {
      list = &selections_[b].indices;
    }
    if (list == nullptr) continue;
    index_at_[b] = static_cast<int64_t>(host_indices_.size());
    host_indices_.insert(host_indices_.end(), list->begin(), list->end());
  }
  if (!host_indices_.empty()) {
    const size_t bytes = host_indices_.size() * sizeof(int32_t);
    IG_RETURN_IF_ERROR(EnsureBuffer(indices_, bytes));
    IG_RETURN_IF_ERROR(backend.CopyToDevice(host_indices_.data(), indices_->data(), bytes));
  }
  auto indices_of = [&](size_t b) {
    return static_cast<const int32_t*>(indices_->data()) + index_at_[b];
  };

  // Pass 2: attention of every chunk over its rows (the fetches in it timed apart); the decode
  // tokens' together at its end (Backend::AttentionDecodeBatch: one launch on a GPU).
  timing.reset();
  decode_items_.clear();
  const double fetch_before = profile_.fetch;
  const Clock::time_point pass2 = Clock::now();
  absl::Cleanup attend_time = [&] {
    if (profiling_) profile_.attend += Since(pass2) - (profile_.fetch - fetch_before);
  };
  const AttentionShape shape{static_cast<int>(c.num_heads), static_cast<int>(c.num_kv_heads),
                             static_cast<int>(c.head_dim),
                             1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  for (size_t b = 0; b < batch.size(); ++b) {
    const ForwardChunk& chunk = batch[b];
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    const int64_t row = rows_[b];
    const Selection& selection = selections_[b];
    if (Failed(b)) continue;  // its rows of `out` stay as they are; no other row reads them
    if (device_plan_ && len == 1) {
      absl::StatusOr<bool> done = AttendOnDevice(b, layer, q, k, v, out);
      if (!done.ok()) FailKv(b, layer, done.status());
      if (!done.ok() || *done) continue;
    }
    if (len > 1 && chunk.start == 0 && streamed_ != nullptr && k.dtype == kv_dtype) {
      // A whole prompt in one chunk: its K/V are the activations; no need to read them back.
      const KvView kk{k.Rows(row, len).data, k.dtype, c.head_dim, k.stride};
      const KvView vv{v.Rows(row, len).data, v.dtype, c.head_dim, v.stride};
      IG_RETURN_IF_ERROR(
          backend.AttentionCausal(q.Rows(row, len), kk, vv, 0, shape, out.Rows(row, len)));
      continue;
    }
    if (len > 1) {
      // (Planned on the device its appends wait for the step's end: the store has the rows
      // before it.)
      absl::StatusOr<KvLayerView> read = resident_ != nullptr ? resident_->Read(chunk.seq, layer)
                                         : device_plan_       ? ReadPromptRows(b, layer, k, v)
                                                        : streamed_->ReadAll(chunk.seq, layer);
      if (read.ok() && read->num_slots != chunk.start + len) {
        Fail(b, absl::FailedPreconditionError(
                    absl::StrCat("prefill of sequence ", chunk.seq, " needs all its ",
                                 chunk.start + len, " tokens in the KV cache, which holds ",
                                 read->num_slots, " (capacity too small)")));
        continue;
      }
      if (!read.ok()) {
        FailKv(b, layer, read.status());
        continue;
      }
      const KvLayerView& kv = *read;
      IG_RETURN_IF_ERROR(backend.AttentionCausal(q.Rows(row, len), kv.k, kv.v, chunk.start, shape,
                                                 out.Rows(row, len)));
    } else if (streamed_ != nullptr && prefetched_[layer % 2][b].layer == layer) {
      // The rows prefetched during the previous layer, packed [num_kv_heads, count], then one
      // row per head for the current token, which this step computed itself.
      const Prefetched& pre = prefetched_[layer % 2][b];
      absl::StatusOr<KvLayerView> fetched = TimedFetch(chunk.seq, layer);
      if (!fetched.ok()) {
        FailKv(b, layer, fetched.status());
        continue;
      }
      KvLayerView& kv = *fetched;
      const int64_t hd = c.head_dim;
      // The current token's K and V, every KV head's row in turn: [kv_heads, head_dim].
      MatView k_cur{k.Rows(row, 1).data, k.dtype, kv_heads, hd, hd};
      MatView v_cur{v.Rows(row, 1).data, v.dtype, kv_heads, hd, hd};
      if (kv.k.rows != nullptr) {   // rows read in place: point at the activations
        if (k.dtype != kv_dtype) {  // or at their copy in the cache's dtype
          uint8_t* base = static_cast<uint8_t*>(current_kv_->data()) +
                          static_cast<size_t>(b) * 2 * kv_heads * hd * DTypeSize(kv_dtype);
          const MatView k_copy{base, kv_dtype, kv_heads, hd, hd};
          const MatView v_copy{base + kv_heads * hd * DTypeSize(kv_dtype), kv_dtype, kv_heads, hd,
                               hd};
          IG_RETURN_IF_ERROR(backend.Copy(k_cur, k_copy));
          IG_RETURN_IF_ERROR(backend.Copy(v_cur, v_copy));
          k_cur = k_copy;
          v_cur = v_copy;
        }
        for (int64_t g = 0; g < kv_heads; ++g) {
          kv.k.rows[kv_heads * pre.count + g] = k_cur.Rows(g, 1).data;
          kv.v.rows[kv_heads * pre.count + g] = v_cur.Rows(g, 1).data;
        }
      } else {  // the rows after every head's, one per KV head: one copy each for K and V
        const int64_t after = kv_heads * (kv.k.head_stride / kv.k.row_stride);
        IG_RETURN_IF_ERROR(backend.Copy(k_cur, kv.k.Head(0, after, kv_heads, hd)));
        IG_RETURN_IF_ERROR(backend.Copy(v_cur, kv.v.Head(0, after, kv_heads, hd)));
      }
      cache_.RecordFetch(chunk.seq, layer, selection.all ? nullptr : selection.indices.data(),
                         selection.all ? pre.count : selection.count);
      IG_RETURN_IF_ERROR(AttentionStep(b, layer, q.Rows(row, 1), kv, indices_of(b),
                                       static_cast<int64_t>(pre.map.size()) / kv_heads, selection,
                                       out.Rows(row, 1)));
    } else if (streamed_ != nullptr) {
      // The rows fetched in pass 1 (all of them, or the selection), packed in selection order.
      absl::StatusOr<KvLayerView> fetched = TimedFetch(chunk.seq, layer);
      if (!fetched.ok()) {
        FailKv(b, layer, fetched.status());
        continue;
      }
      const KvLayerView& kv = *fetched;
      cache_.RecordFetch(chunk.seq, layer, selection.all ? nullptr : selection.indices.data(),
                         selection.all ? kv.num_slots : selection.count);
      IG_RETURN_IF_ERROR(AttentionStep(b, layer, q.Rows(row, 1), kv, nullptr, kv.num_slots,
                                       selection, out.Rows(row, 1)));
    } else {
      absl::StatusOr<KvLayerView> read = resident_->Read(chunk.seq, layer);
      if (!read.ok()) {
        FailKv(b, layer, read.status());
        continue;
      }
      const KvLayerView& kv = *read;
      if (selection.all) {
        IG_RETURN_IF_ERROR(AttentionStep(b, layer, q.Rows(row, 1), kv, nullptr, kv.num_slots,
                                         selection, out.Rows(row, 1)));
        continue;
      }
      const int64_t rows = selection.count;
      cache_.RecordFetch(chunk.seq, layer, selection.indices.data(), rows);
      IG_RETURN_IF_ERROR(AttentionStep(b, layer, q.Rows(row, 1), kv, indices_of(b), rows, selection,
                                       out.Rows(row, 1)));
    }
  }
  if (!decode_items_.empty()) {
    IG_RETURN_IF_ERROR(backend.AttentionDecodeBatch(decode_items_, shape));
  }
  // Planned on the device: the plans' counts come back with the logits (the step's one wait).
  if (device_plan_ && layer + 1 == c.num_layers) IG_RETURN_IF_ERROR(streamed_->QueueDeviceCounts());
  return absl::OkStatus();
}

absl::StatusOr<KvLayerView> DecodeStep::TimedFetch(SequenceId seq, int layer) {
  ScopedTiming timing(Timing(&StepProfile::fetch));
  if (!profiling_) return streamed_->Fetch(seq, layer);
  const double waited = cache_.Counters(seq).wait_seconds;
  absl::StatusOr<KvLayerView> fetched = streamed_->Fetch(seq, layer);
  profile_.fetch_wait += cache_.Counters(seq).wait_seconds - waited;
  return fetched;
}

bool DecodeStep::MapPrefetched(size_t b, int layer, const Selection& selection,
                               const int32_t* current_slots) {
  Prefetched& pre = prefetched_[layer % 2][b];
  if (pre.layer != layer) return false;
  const int64_t kv_heads = model_.config().num_kv_heads;
  // Where the cache answers the prefetched rows: packed in list order, or where it keeps them
  // (row reuse): the j-th candidate of head g at row_of(g, j) of head g's rows.
  const StreamedKvCache::RowPlacement placed = streamed_->Placement(batch_[b].seq, layer);
  const int64_t per_head = placed.rows != nullptr ? placed.rows_per_head : pre.count;
  auto row_of = [&](int64_t g, int64_t j) {
    return placed.rows != nullptr ? placed.rows[g * pre.count + j] : static_cast<int32_t>(j);
  };
  // Row of the staging, relative to head g's first row, that holds the current token.
  auto current = [&](int64_t g) {
    return static_cast<int32_t>(kv_heads * per_head + g - g * per_head);
  };
  if (selection.all) {
    if (!pre.dense) return Miss(pre);
    // Every stored row in slot order, and the current token: in the next slot, or (a full KV
    // pool; every head is as full) in the slot it took from a token it evicted.
    const bool next_slot = current_slots[0] >= pre.count;
    const int64_t rows = next_slot ? pre.count + 1 : pre.count;
    pre.map.resize(static_cast<size_t>(kv_heads * rows));
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t j = 0; j < pre.count; ++j) pre.map[g * rows + j] = row_of(g, j);
      pre.map[g * rows + (next_slot ? pre.count : current_slots[g])] = current(g);
    }
    ++prefetch_hits_;
    return true;
  }
  const int64_t count = selection.count;
  pre.map.resize(static_cast<size_t>(kv_heads * count));
  for (int64_t g = 0; g < kv_heads; ++g) {
    const int32_t* begin = pre.slots.data() + g * pre.count;
    const int32_t* end = begin + pre.count;
    // Both lists ascend (the policies choose in slot order): one walk forward through the
    // candidates, not a search per row (at 32K tokens that search was milliseconds per layer).
    // A selection out of order finds nothing behind the walk and fetches again.
    const int32_t* it = begin;
    for (int64_t j = 0; j < count; ++j) {
      const int32_t slot = selection.indices[g * count + j];
      int32_t at;
      if (slot == current_slots[g]) {
        at = current(g);
      } else if (pre.dense) {  // every stored slot, in slot order
        if (slot < 0 || slot >= pre.count) return Miss(pre);
        at = row_of(g, slot);
      } else {
        while (it != end && *it < slot) ++it;
        if (it == end || *it != slot) return Miss(pre);
        at = row_of(g, it - begin);
      }
      pre.map[g * count + j] = at;
    }
  }
  ++prefetch_hits_;
  return true;
}

bool DecodeStep::Miss(Prefetched& pre) {
  pre.layer = -1;  // the caller fetches the exact selection
  pre.on_device = false;
  ++prefetch_misses_;
  return false;
}

absl::Status DecodeStep::AttentionStep(size_t b, int layer, MatView q, const KvLayerView& kv,
                                       const int32_t* indices, int64_t rows,
                                       const Selection& selection, MatView out) {
  const ModelConfig& c = model_.config();
  Backend& backend = model_.backend();
  const AttentionShape shape{static_cast<int>(c.num_heads), static_cast<int>(c.num_kv_heads),
                             static_cast<int>(c.head_dim),
                             1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  KvSelectionPolicy* policy = batch_[b].policy;
  float* weights = nullptr;
  if (policy == nullptr || !policy->wants_attention_weights()) {
    // With the batch's others, in one call after pass 2 (AttendBatch).
    decode_items_.push_back({q, kv.k, kv.v, indices, rows, out});
    return absl::OkStatus();
  }
  IG_RETURN_IF_ERROR(EnsureBuffer(weights_, c.num_heads * rows * sizeof(float)));
  weights = static_cast<float*>(weights_->data());
  IG_RETURN_IF_ERROR(backend.AttentionDecode(q, kv.k, kv.v, indices, rows, shape, out, weights));
  if (weights != nullptr) {
    host_weights_.resize(static_cast<size_t>(c.num_heads * rows));
    IG_RETURN_IF_ERROR(
        backend.CopyToHost(weights, host_weights_.data(), host_weights_.size() * sizeof(float)));
    policy->OnAttentionWeights(batch_[b].seq, layer, selection, host_weights_.data(), rows);
  }
  return absl::OkStatus();
}

}  // namespace infinigen
