// DecodeStep planned on the device (docs/worker.md, "Rows planned on the device"): where every
// decode token's policy chooses in backend memory (InfiniGen on a GPU) and the cache plans its
// rows there (StoreKvCache with plan_on_device), the next layer's prefetch and the layer's own
// choice are handed to the cache as they lie in backend memory (slots and count), the attention
// reads its count there, and the appends wait for the step's end: no choice is read on the
// host and the backend waits for nothing between the layers. A prompt chunk in the same step (a
// prefill beside the decodes) attends the rows stored before it (the store's answer awaited as
// ReadAll's is, no backend wait) and its own from the activations (ReadPromptRows).
#include <algorithm>

#include "common/status_macros.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/engine/step_timing.h"

namespace infinigen {

using step_timing::ScopedTiming;

bool DecodeStep::DevicePlanFits(std::span<const ForwardChunk> batch) const {
  if (streamed_ == nullptr) return false;
  const int layers = model_.config().num_layers;
  bool decodes = false;
  for (size_t b = 0; b < batch.size(); ++b) {
    const ForwardChunk& chunk = batch[b];
    // Prompt chunks choose no rows; their appends are held too, where their attention can read
    // the rows stored before them apart from their own (StreamedKvCache::ReadStored).
    // A host policy's keys are read on the host each layer: the host's path, where it waits.
    if (chunk.tokens.size() != 1) {
      if (chunk.start > 0 && !streamed_->ReadsStored(chunk.seq)) return false;
      if (chunk.policy != nullptr && !chunk.policy->chooses_on_backend()) return false;
      continue;
    }
    const KvSelectionPolicy* policy = chunk.policy;
    if (Failed(b) || policy == nullptr || !policy->chooses_on_backend() ||
        policy->wants_attention_weights() || spec_rows_[b] < 0) {
      return false;
    }
    // Every layer it may choose at (its speculated ones) is planned there, for as many rows as
    // it may choose (a request whose budget is above what the cache keeps takes the host's path).
    const int64_t most = policy->BackendChoiceCapacity(chunk.start);
    for (int layer = 0; layer < layers; ++layer) {
      if (policy->SpeculatesFor(layer) && !streamed_->PlansOnDevice(chunk.seq, layer, most)) {
        return false;
      }
    }
    decodes = true;
  }
  return decodes;
}

DeviceSlotList DecodeStep::DeviceChoice(const Choices& c, size_t b) const {
  // LaunchChoices' layout: the count, then kv_heads lists of capacity[b] slots.
  const int32_t* count = static_cast<const int32_t*>(c.device->data()) + c.at[b];
  return {count + 1, count, c.capacity[b], c.capacity[b]};
}

absl::StatusOr<bool> DecodeStep::PrefetchOnDevice(size_t b, int next_layer, int64_t stored) {
  const SequenceId seq = batch_[b].seq;
  if (!streamed_->PlansOnDevice(seq, next_layer, 0)) return false;
  const bool launched =
      preselect_.result.size() > b && preselect_.result[b] == BackendChoiceResult::kLaunched;
  // The policy's choice where it launched one, else every stored row (a dense layer, a short
  // sequence: what the policy said at launch).
  const DeviceSlotList list =
      launched ? DeviceChoice(preselect_, b) : DeviceSlotList{nullptr, nullptr, stored, stored};
  const absl::Status st = streamed_->PrefetchOnDevice(seq, next_layer, list);
  if (!launched && absl::IsInvalidArgument(st)) return false;  // more rows than it keeps
  IG_RETURN_IF_ERROR(st);
  Prefetched& pre = prefetched_[next_layer % 2][b];
  pre.layer = next_layer;
  pre.on_device = true;
  pre.dense = !launched;
  pre.count = stored;
  return true;
}

absl::StatusOr<bool> DecodeStep::AttendOnDevice(size_t b, int layer, MatView q, MatView k,
                                                MatView v, MatView out) {
  const ForwardChunk& chunk = batch_[b];
  const bool launched =
      select_.result.size() > b && select_.result[b] == BackendChoiceResult::kLaunched;
  const Prefetched& pre = prefetched_[layer % 2][b];
  const bool prefetched = pre.layer == layer && pre.on_device;
  if (!launched && !prefetched) return false;  // every row, prefetched by the host
  // The choice, or every stored row and the current token (slots are positions: no KV pool).
  const int64_t stored = chunk.start;
  const DeviceSlotList choice = launched ? DeviceChoice(select_, b)
                                         : DeviceSlotList{nullptr, nullptr, stored + 1, stored + 1};
  absl::StatusOr<StreamedKvCache::DeviceRows> rows;
  {
    ScopedTiming timing(Timing(&StepProfile::fetch));
    rows = streamed_->FetchOnDevice(chunk.seq, layer, choice, stored);
  }
  if (!rows.ok()) return rows.status();
  if (prefetched) ++prefetch_hits_;
  // The current token's K and V into the rows after every head's, one copy each.
  const ModelConfig& c = model_.config();
  const int64_t kv_heads = c.num_kv_heads, hd = c.head_dim, row = rows_[b];
  const KvLayerView& kv = rows->kv;
  const int64_t after = kv_heads * (kv.k.head_stride / kv.k.row_stride);
  Backend& backend = model_.backend();
  IG_RETURN_IF_ERROR(backend.Copy(MatView{k.Rows(row, 1).data, k.dtype, kv_heads, hd, hd},
                                  kv.k.Head(0, after, kv_heads, hd)));
  IG_RETURN_IF_ERROR(backend.Copy(MatView{v.Rows(row, 1).data, v.dtype, kv_heads, hd, hd},
                                  kv.v.Head(0, after, kv_heads, hd)));
  DecodeAttentionItem item;
  item.q = q.Rows(row, 1);
  item.k = kv.k;
  item.v = kv.v;
  item.indices = rows->indices;
  item.num_rows = choice.capacity;
  item.count = choice.count;  // in backend memory (null: every row)
  item.out = out.Rows(row, 1);
  decode_items_.push_back(item);
  return true;
}

absl::StatusOr<KvLayerView> DecodeStep::ReadPromptRows(size_t b, int layer, MatView k, MatView v) {
  const ForwardChunk& chunk = batch_[b];
  const int64_t len = static_cast<int64_t>(chunk.tokens.size());
  absl::StatusOr<KvLayerView> read = streamed_->ReadStored(chunk.seq, layer, chunk.start, len);
  if (!read.ok()) return read.status();
  const ModelConfig& c = model_.config();
  const int64_t hd = c.head_dim, row = rows_[b];
  Backend& backend = model_.backend();
  // Head g's columns of the chunk's rows, after the head's stored rows (converted to the
  // cache's dtype by the copy).
  for (int64_t g = 0; g < c.num_kv_heads; ++g) {
    for (auto [from, to] : {std::pair{k, read->k}, std::pair{v, read->v}}) {
      const MatView src{static_cast<uint8_t*>(from.Rows(row, len).data) +
                            static_cast<size_t>(g * hd) * DTypeSize(from.dtype),
                        from.dtype, len, hd, from.stride};
      IG_RETURN_IF_ERROR(backend.Copy(src, to.Head(g, chunk.start, len, hd)));
    }
  }
  return read;
}

void DecodeStep::EndDevicePlan() {
  device_plan_ = false;
  // A step cut short (an error between the layers) skipped QueueDeviceCounts' join: its plans
  // and gathers still read the choices and the kept rows, which the next step writes.
  if (absl::Status st = streamed_->JoinDevicePrefetches(-1); !st.ok()) {
    for (size_t b = 0; b < batch_.size(); ++b) Fail(b, st);
  }
  // The plans' counts first (a sequence whose plan did not fit has its held appends dropped:
  // what its later layers computed from a wrong row never reaches the store), then the appends,
  // whose rows the logits' copy waited for too: they go to the store without a wait.
  for (size_t b = 0; b < batch_.size(); ++b) {
    absl::Status st = streamed_->SettleOnDevice(batch_[b].seq);
    if (!st.ok()) Fail(b, std::move(st));
  }
  streamed_->EndAppendLayer();
}

}  // namespace infinigen
