#include "gpu_worker/engine/decode_step.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/engine/step_timing.h"
#include "kernels/cpu/parallel_for.h"

namespace infinigen {

using step_timing::Clock;
using step_timing::ScopedTiming;
using step_timing::Since;

DecodeStep::DecodeStep(Model& model, KvCache& cache) : model_(model), cache_(cache) {
  // The one place that asks what kind of cache this is.
  resident_ = dynamic_cast<ResidentKvCache*>(&cache);
  streamed_ = dynamic_cast<StreamedKvCache*>(&cache);
}

DecodeStep::~DecodeStep() {
  // Copies of a failed step still queued into the choices' host buffers land before they go.
  if (select_.launched || preselect_.launched) model_.backend().Synchronize().IgnoreError();
}

int64_t DecodeStep::NumLogitRows(std::span<const ForwardChunk> batch) {
  int64_t rows = 0;
  for (const ForwardChunk& c : batch) {
    rows += c.all_logits ? static_cast<int64_t>(c.tokens.size()) : (c.tokens.empty() ? 0 : 1);
  }
  return rows;
}

absl::Status DecodeStep::EnsureBuffer(std::unique_ptr<Buffer>& b, size_t bytes) {
  if (b != nullptr && b->size() >= bytes) return absl::OkStatus();
  // Geometric growth: buffers sized by a sequence's length (row maps, weights) grow a row per
  // step, and an allocation per step would be a device allocation (and wait) per step.
  const size_t grown = b != nullptr ? std::max(bytes, b->size() + b->size() / 2) : bytes;
  b.reset();
  IG_ASSIGN_OR_RETURN(b, model_.backend().Allocate(std::max<size_t>(grown, 64)));
  return absl::OkStatus();
}

void DecodeStep::Fail(size_t b, absl::Status status) {
  if (chunk_status_[b].ok()) chunk_status_[b] = std::move(status);
}

void DecodeStep::FailKv(size_t b, int layer, const absl::Status& status) {
  // Rows lost (the store no longer has the sequence: NOT_FOUND) or late (DEADLINE_EXCEEDED)
  // are ABORTED: the sequence can be continued elsewhere. Other codes stay what they are (the
  // store unreachable or full, a cache's capacity, the request's own bad input).
  const absl::StatusCode code = absl::IsNotFound(status) || absl::IsDeadlineExceeded(status)
                                    ? absl::StatusCode::kAborted
                                    : status.code();
  Fail(b, absl::Status(code, absl::StrCat("the KV cache failed sequence ", batch_[b].seq,
                                          " at layer ", layer, ": ", status.message())));
}

void DecodeStep::ForEachPolicy(absl::FunctionRef<absl::Status(size_t)> work) {
  policy_chunks_.clear();
  for (size_t b = 0; b < batch_.size(); ++b) {
    if (batch_[b].policy != nullptr && !Failed(b)) policy_chunks_.push_back(b);
  }
  const int64_t m = static_cast<int64_t>(policy_chunks_.size());
  // A policy keeps per-sequence state and is not thread-safe; separate policies are independent.
  bool distinct = m > 1;
  for (int64_t i = 0; i < m && distinct; ++i) {
    for (int64_t j = 0; j < i && distinct; ++j) {
      distinct = batch_[policy_chunks_[i]].policy != batch_[policy_chunks_[j]].policy;
    }
  }
  statuses_.assign(static_cast<size_t>(m), absl::OkStatus());
  if (distinct) {
    // Static: each thread gets the same sequences of a batch every time, so the selection
    // kernels' per-thread scratch (kernels/cpu/selection.cc) reaches its size once; dynamic
    // hand-out gave a thread a longer sequence than it had seen now and then, and a host
    // allocation in a decode step (decode_step_alloc_test, under load).
    cpu::ParallelFor(m, true, [&](int64_t i) { statuses_[i] = work(policy_chunks_[i]); });
  } else {
    // On this thread, so that a policy's own parallel loops use the team.
    for (int64_t i = 0; i < m; ++i) statuses_[i] = work(policy_chunks_[i]);
  }
  for (int64_t i = 0; i < m; ++i) {
    if (!statuses_[i].ok()) Fail(policy_chunks_[i], std::move(statuses_[i]));
  }
}

absl::Status DecodeStep::LaunchChoices(Choices& c, int layer, bool prefetch) {
  // A copy of a step that failed before its wait must land before c.host is reused.
  if (c.launched) IG_RETURN_IF_ERROR(model_.backend().Synchronize());
  c.launched = false;
  const size_t n = batch_.size();
  c.result.assign(n, BackendChoiceResult::kNone);  // (what each chunk's choice did, read later)
  if (c.chunks.empty()) return absl::OkStatus();
  Backend& backend = model_.backend();
  const int64_t kv_heads = model_.config().num_kv_heads;
  c.at.resize(n);
  c.capacity.resize(n);
  int64_t total = 0;
  for (size_t b : c.chunks) {
    const int64_t stored = prefetch ? c.rows[b] : c.rows[b] - 1;
    c.capacity[b] = batch_[b].policy->BackendChoiceCapacity(stored);
    c.at[b] = total;
    total += 1 + kv_heads * c.capacity[b];
  }
  if (prefetch && device_plan_) {  // see Choices::other
    std::swap(c.device, c.other);
    std::swap(c.device_layer, c.other_layer);
    // Its last readers, the plans of the layer whose choice it held (two layers back), are
    // joined already where every layer prefetches (the next layer's batch joins the one
    // before it): ordered here whatever ran.
    if (c.device_layer >= 0) IG_RETURN_IF_ERROR(streamed_->JoinDevicePrefetches(c.device_layer));
    c.device_layer = layer;
  }
  IG_RETURN_IF_ERROR(EnsureBuffer(c.device, static_cast<size_t>(total) * sizeof(int32_t)));
  int32_t* device = static_cast<int32_t*>(c.device->data());
  const bool speculated = spec_layer_[layer % 2] == layer;
  for (size_t b : c.chunks) {
    BackendChoice choice;
    choice.seq = batch_[b].seq;
    choice.layer = layer;
    choice.rows = c.rows[b];
    choice.prefetch = prefetch;
    if (speculated && spec_rows_[b] >= 0)
      choice.speculated_q = SpeculatedRows(layer).Rows(spec_rows_[b], 1);
    choice.count = device + c.at[b];
    choice.indices = choice.count + 1;
    choice.index_capacity = c.capacity[b];
    absl::StatusOr<BackendChoiceResult> result = batch_[b].policy->ChooseOnBackend(choice);
    c.result[b] = result.ok() ? *result : BackendChoiceResult::kNone;
    if (!result.ok()) Fail(b, result.status());
    c.launched = c.launched || c.result[b] == BackendChoiceResult::kLaunched;
  }
  if (device_plan_) {
    c.launched = false;     // read where they lie (decode_step_device_plan.cc): nothing to copy
  } else if (c.launched) {  // one copy for every chunk's choice, done at the next wait
    c.host.resize(static_cast<size_t>(total));
    IG_RETURN_IF_ERROR(backend.CopyToHostLater(device, c.host.data(), total * sizeof(int32_t)));
  }
  return absl::OkStatus();
}

void DecodeStep::CollectChoices(Choices& c, absl::FunctionRef<Selection&(size_t)> out) {
  const int64_t kv_heads = model_.config().num_kv_heads;
  for (size_t b : c.chunks) {
    if (Failed(b)) continue;
    Selection& selection = out(b);
    if (c.result[b] != BackendChoiceResult::kLaunched) {
      selection.all = true;
      continue;
    }
    const int32_t* host = c.host.data() + c.at[b];
    const int64_t count = host[0];
    if (count <= 0 || count > c.capacity[b]) {
      Fail(b, absl::InternalError(absl::StrCat("policy ", batch_[b].policy->Name(), " chose ",
                                               count, " rows of ", c.rows[b])));
      continue;
    }
    selection.all = false;
    selection.count = count;
    selection.indices.resize(static_cast<size_t>(kv_heads * count));
    for (int64_t g = 0; g < kv_heads; ++g) {
      std::copy_n(host + 1 + g * c.capacity[b], count, selection.indices.begin() + g * count);
    }
  }
}

absl::Status DecodeStep::ToHost(std::span<const MatView> views, std::span<HostRows*> out,
                                std::vector<float>& host) {
  Backend& backend = model_.backend();
  if (backend.host_accessible()) {
    for (size_t i = 0; i < views.size(); ++i)
      *out[i] = {views[i].As<const float>(), views[i].stride};
    return absl::OkStatus();
  }
  size_t count = 0;
  for (const MatView& m : views) count += static_cast<size_t>(m.rows * m.cols);
  IG_RETURN_IF_ERROR(EnsureBuffer(mirror_, count * sizeof(float)));
  // Converted (the activations' type to float32) and packed one after another on the device,
  // then one copy: one wait for all of them.
  float* staging = static_cast<float*>(mirror_->data());
  size_t at = 0;
  for (const MatView& m : views) {
    IG_RETURN_IF_ERROR(backend.Copy(m, MatView{staging + at, DType::kF32, m.rows, m.cols, m.cols}));
    at += static_cast<size_t>(m.rows * m.cols);
  }
  host.resize(count);
  IG_RETURN_IF_ERROR(backend.CopyToHost(staging, host.data(), count * sizeof(float)));
  at = 0;
  for (size_t i = 0; i < views.size(); ++i) {
    *out[i] = {host.data() + at, views[i].cols};
    at += static_cast<size_t>(views[i].rows * views[i].cols);
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeStep::HostRows> DecodeStep::ToHost(MatView m, std::vector<float>& host) {
  HostRows rows;
  HostRows* out[] = {&rows};
  IG_RETURN_IF_ERROR(ToHost({&m, 1}, out, host));
  return rows;
}

absl::Status DecodeStep::Plan(std::span<const ForwardChunk> batch) {
  if (resident_ == nullptr && streamed_ == nullptr) {
    return absl::InternalError("the KV cache is neither resident nor streamed");
  }
  const ModelConfig& c = model_.config();
  Backend& backend = model_.backend();
  batch_ = batch;
  model_chunks_.clear();
  rows_.assign(batch.size(), 0);
  spec_rows_.assign(batch.size(), -1);
  host_spec_positions_.clear();
  num_tokens_ = 0;
  speculating_ = false;
  chunk_status_.assign(batch.size(), absl::OkStatus());
  for (size_t b = 0; b < batch.size(); ++b) {
    const ForwardChunk& chunk = batch[b];
    model_chunks_.push_back({chunk.start, chunk.tokens, chunk.all_logits});
    rows_[b] = num_tokens_;
    num_tokens_ += static_cast<int64_t>(chunk.tokens.size());
    KvSelectionPolicy* policy = chunk.policy;
    if (policy == nullptr) continue;
    if (policy->needs_resident_kv() && (resident_ == nullptr || !backend.host_accessible())) {
      Fail(b, absl::FailedPreconditionError(
                  absl::StrCat("policy ", policy->Name(),
                               " reads stored K rows itself and needs a resident KV cache",
                               backend.host_accessible() ? "" : " in host memory (the cpu backend)",
                               "; infinigen, window and full run over any cache and backend")));
      continue;
    }
    if (chunk.tokens.size() != 1 || policy->speculation_input() == SpeculationInput::kNone) {
      continue;
    }
    if (model_.speculation() == nullptr) {
      Fail(b, absl::FailedPreconditionError(
                  absl::StrCat("policy ", policy->Name(),
                               " speculates, but the model has no speculation weights (attach "
                               "the InfiniGen sidecar's partial channels)")));
      continue;
    }
    speculating_ = true;
    spec_rows_[b] = static_cast<int64_t>(host_spec_positions_.size());
    host_spec_positions_.push_back(static_cast<int32_t>(chunk.start));
  }
  num_spec_rows_ = static_cast<int64_t>(host_spec_positions_.size());
  host_slots_.resize(static_cast<size_t>(num_tokens_ * c.num_kv_heads));
  // Per-chunk state only grows: a slot's vectors keep their capacity for the next batch.
  if (selections_.size() < batch.size()) selections_.resize(batch.size());
  if (chunks_.size() < batch.size()) chunks_.resize(batch.size());
  select_.rows.resize(batch.size());
  preselect_.rows.resize(batch.size());
  spec_layer_[0] = spec_layer_[1] = -1;
  for (auto& per_chunk : prefetched_) {
    if (per_chunk.size() < batch.size()) per_chunk.resize(batch.size());
    for (Prefetched& p : per_chunk) {
      p.layer = -1;
      p.on_device = false;
    }
  }
  device_plan_ = DevicePlanFits(batch);
  if (device_plan_) {
    device_decodes_.clear();  // (its room kept: no allocation once the batch was this large)
    for (const ForwardChunk& chunk : batch) {
      if (chunk.tokens.size() == 1) device_decodes_.push_back(chunk.seq);
    }
    device_plan_ = streamed_->BeginAppendStep(num_tokens_, device_decodes_);
  }
  if (speculating_) {
    const size_t e = DTypeSize(backend.activation_dtype());
    const int64_t m = num_spec_rows_;
    const int64_t p = model_.speculation()->partial_dim();
    IG_RETURN_IF_ERROR(EnsureBuffer(spec_in_, m * c.hidden_size * e));
    IG_RETURN_IF_ERROR(EnsureBuffer(spec_scratch_, m * c.q_dim() * e));
    IG_RETURN_IF_ERROR(EnsureBuffer(spec_q_[0], m * c.num_heads * p * e));
    IG_RETURN_IF_ERROR(EnsureBuffer(spec_q_[1], m * c.num_heads * p * e));
    IG_RETURN_IF_ERROR(EnsureBuffer(spec_positions_, m * sizeof(int32_t)));
    IG_RETURN_IF_ERROR(backend.CopyToDevice(host_spec_positions_.data(), spec_positions_->data(),
                                            m * sizeof(int32_t)));
  }
  return absl::OkStatus();
}

absl::Status DecodeStep::Forward(std::span<const ForwardChunk> batch, std::span<float> logits) {
  completed_ = false;
  const Clock::time_point t0 = Clock::now();
  const BackendCounters counters0 = model_.backend().counters();
  profiling_ = !batch.empty() && static_cast<int64_t>(batch.size()) >= profile_min_batch() &&
               std::all_of(batch.begin(), batch.end(),
                           [](const ForwardChunk& c) { return c.tokens.size() == 1; });
  device_plan_ = false;
  absl::Cleanup end_plan = [this] {
    if (device_plan_) EndDevicePlan();
  };
  IG_RETURN_IF_ERROR(Plan(batch));
  // Layer 0's rows start moving before the embedding; every later layer's during the one
  // before it.
  if (streamed_ != nullptr && num_tokens_ > 0) IG_RETURN_IF_ERROR(Prefetch(0));
  IG_RETURN_IF_ERROR(model_.Forward(model_chunks_, *this, logits));
  if (device_plan_) EndDevicePlan();  // before the profile: its store calls are the step's
  completed_ = true;
  if (profiling_) {
    profile_.steps += 1;
    profile_.layers += model_.config().num_layers;
    profile_.sequences += static_cast<int64_t>(batch.size());
    profile_.total += Since(t0);
    profile_.backend += model_.backend().counters() - counters0;
  }
  for (const absl::Status& st : chunk_status_) IG_RETURN_IF_ERROR(st);
  return absl::OkStatus();
}

absl::Status DecodeStep::Restore(SequenceId seq, KvSelectionPolicy& policy, int64_t length) {
  if (length <= 0) return absl::OkStatus();
  if (policy.needs_resident_kv() || policy.wants_attention_weights()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "policy ", policy.Name(), " cannot continue a sequence from its stored keys alone"));
  }
  const ModelConfig& c = model_.config();
  Backend& backend = model_.backend();
  const int64_t kv_heads = c.num_kv_heads, d = c.head_dim, width = kv_heads * d;
  IG_RETURN_IF_ERROR(EnsureBuffer(restore_, static_cast<size_t>(length * width) * sizeof(float)));
  host_slots_.resize(static_cast<size_t>(length * kv_heads));
  for (int64_t t = 0; t < length; ++t) {
    std::fill_n(host_slots_.begin() + t * kv_heads, kv_heads, static_cast<int32_t>(t));
  }
  const MatView keys{restore_->data(), DType::kF32, length, width, width};
  for (int layer = 0; layer < c.num_layers; ++layer) {
    absl::StatusOr<KvLayerView> kv =
        resident_ != nullptr ? resident_->Read(seq, layer) : streamed_->ReadAll(seq, layer);
    if (!kv.ok()) return kv.status();
    if (kv->num_slots < length) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", layer, " holds ", kv->num_slots, " tokens, not ", length));
    }
    for (int64_t g = 0; g < kv_heads; ++g) {  // head-major rows to token-major floats
      IG_RETURN_IF_ERROR(backend.Copy(kv->k.Head(g, 0, length, d), keys.Cols(g * d, d)));
    }
    if (policy.chooses_on_backend()) {
      IG_RETURN_IF_ERROR(policy.OnBackendKeys(seq, layer, keys, 0));
      continue;
    }
    IG_ASSIGN_OR_RETURN(HostRows host_k, ToHost(keys, host_k_));
    LayerKeys lk;
    lk.seq = seq;
    lk.layer = layer;
    lk.start = 0;
    lk.count = length;
    lk.k = host_k.data;
    lk.k_stride = host_k.stride;
    lk.slots = host_slots_.data();
    lk.kv.num_slots = length;
    IG_RETURN_IF_ERROR(policy.OnKeys(lk));
  }
  return absl::OkStatus();
}

MatView DecodeStep::SpeculatedRows(int layer) const {
  const int64_t cols = model_.config().num_heads * model_.speculation()->partial_dim();
  return {spec_q_[layer % 2]->data(), model_.backend().activation_dtype(), num_spec_rows_, cols,
          cols};
}

absl::Status DecodeStep::Speculate(int next_layer, MatView in, MatView residual) {
  const ModelConfig& c = model_.config();
  Backend& backend = model_.backend();
  const DType t = backend.activation_dtype();
  const MatView spec_in{spec_in_->data(), t, num_spec_rows_, c.hidden_size, c.hidden_size};
  for (size_t b = 0; b < batch_.size(); ++b) {
    if (spec_rows_[b] < 0) continue;
    const MatView dst = spec_in.Rows(spec_rows_[b], 1);
    if (batch_[b].policy->speculation_input() == SpeculationInput::kThisLayerNorm) {
      IG_RETURN_IF_ERROR(model_.AttentionNorm(next_layer, residual.Rows(rows_[b], 1), dst));
    } else {
      IG_RETURN_IF_ERROR(backend.Copy(in.Rows(rows_[b], 1), dst));
    }
  }
  const MatView scratch{spec_scratch_->data(), t, num_spec_rows_, c.q_dim(), c.q_dim()};
  return model_.SpeculatePartialQuery(next_layer, spec_in,
                                      static_cast<const int32_t*>(spec_positions_->data()), scratch,
                                      SpeculatedRows(next_layer));
}

absl::Status DecodeStep::BeforeLayer(int layer, MatView attention_input, MatView residual) {
  if (layer + 1 >= model_.config().num_layers) return absl::OkStatus();
  // Speculation for the next layer from this layer's attention input; over a streamed cache,
  // its rows start moving now and arrive while this layer computes.
  spec_layer_[(layer + 1) % 2] = -1;
  bool speculate = false;
  for (size_t b = 0; b < batch_.size() && speculating_ && !speculate; ++b) {
    speculate = spec_rows_[b] >= 0 && batch_[b].policy->SpeculatesFor(layer + 1);
  }
  if (speculate) {
    ScopedTiming timing(Timing(&StepProfile::speculate));
    IG_RETURN_IF_ERROR(Speculate(layer + 1, attention_input, residual));
    spec_layer_[(layer + 1) % 2] = layer + 1;
  }
  return absl::OkStatus();
}

void DecodeStep::EverySlot(int64_t kv_heads, int64_t stored, std::vector<int32_t>& out) {
  out.resize(static_cast<size_t>(kv_heads * stored));
  for (int64_t g = 0; g < kv_heads; ++g) {
    std::iota(out.begin() + g * stored, out.begin() + (g + 1) * stored, 0);
  }
}

absl::Status DecodeStep::Prefetch(int next_layer) {
  IG_RETURN_IF_ERROR(PrefetchBegin(next_layer));
  if (preselect_.launched) IG_RETURN_IF_ERROR(model_.backend().Synchronize());
  preselect_.launched = false;
  return PrefetchEnd(next_layer);
}

absl::Status DecodeStep::PrefetchBegin(int next_layer) {
  StreamedKvCache& cache = *streamed_;
  const int64_t kv_heads = model_.config().num_kv_heads;
  preselect_.chunks.clear();
  // The speculated queries of the layer, for policies that preselect from them.
  const bool preselect = !cache.addresses_only();
  std::optional<ScopedTiming> timing(Timing(&StepProfile::preselect));
  HostRows spec_q;
  const bool speculated = spec_layer_[next_layer % 2] == next_layer;
  bool host_speculation = false;  // a policy choosing on the host reads the speculation
  for (size_t b = 0; b < batch_.size() && speculated; ++b) {
    host_speculation = host_speculation || (spec_rows_[b] >= 0 && !ChoosesOnBackend(b));
  }
  if (host_speculation && preselect) {
    IG_ASSIGN_OR_RETURN(spec_q, ToHost(SpeculatedRows(next_layer), host_spec_q_));
  }
  // Which decode chunks fetch, and how many rows they have stored (in order: cache calls).
  for (size_t b = 0; b < batch_.size(); ++b) {
    ChunkWork& w = chunks_[b];
    w.stored = 0;
    w.fetch = false;
    w.candidates.all = true;  // every row unless a policy guesses fewer
    prefetched_[next_layer % 2][b].layer = -1;
    prefetched_[next_layer % 2][b].on_device = false;
    if (batch_[b].tokens.size() != 1 || Failed(b)) continue;
    absl::StatusOr<int64_t> stored = cache.NumSlots(batch_[b].seq, next_layer);
    if (!stored.ok()) {
      FailKv(b, next_layer, stored.status());
      continue;
    }
    w.stored = *stored;
    ReserveRowLists(b, kv_heads * (w.stored + 1));
    // Where the cache answers addresses in place, a sequence whose policy chooses on the host
    // asks for exactly its selection at the layer (in Attend, decode_step_attend.cc): the addresses
    // of every stored row, looked up there, cost more than its choice saves (3 ns a row, every
    // layer).
    w.fetch = w.stored > 0 && (preselect || batch_[b].policy == nullptr || ChoosesOnBackend(b));
  }
  // The policies' guesses, sequences in parallel (every row without a policy). Where a prefetch
  // answers addresses, host policies guess nothing: they choose at the layer (above).
  if (preselect) {
    ForEachPolicy([&](size_t b) {
      ChunkWork& w = chunks_[b];
      if (!w.fetch || ChoosesOnBackend(b)) return absl::OkStatus();
      KvSelectionPolicy* policy = batch_[b].policy;
      SelectRequest request;
      request.seq = batch_[b].seq;
      request.layer = next_layer;
      request.position = batch_[b].start;
      request.kv.num_slots = w.stored;
      if (speculated && spec_rows_[b] >= 0) {
        request.speculated_q = spec_q.Row(spec_rows_[b]);
      }
      w.fetch = policy->Preselect(request, w.candidates);  // false: no guess, nothing fetched
      return absl::OkStatus();
    });
    // And the policies that choose in backend memory: launched now, read after the next wait.
    preselect_.chunks.clear();
    for (size_t b = 0; b < batch_.size(); ++b) {
      if (chunks_[b].fetch && !Failed(b) && ChoosesOnBackend(b)) {
        preselect_.chunks.push_back(b);
        preselect_.rows[b] = chunks_[b].stored;
      }
    }
    IG_RETURN_IF_ERROR(LaunchChoices(preselect_, next_layer, /*prefetch=*/true));
  }
  return absl::OkStatus();
}

void DecodeStep::ReserveRowLists(size_t b, int64_t entries) {
  // Twice what is needed when short: a sequence grows a row a step, and a selection's size
  // depends on its data, so sizing for every row (and then some) is what lets a warmed-up
  // step allocate nothing. At most 6 lists x 2 x 4 bytes per stored row and KV head: under 10%
  // of the row's K and V (head_dim 64 in bf16: 256 bytes), which live in the store.
  auto reserve = [entries](std::vector<int32_t>& v) {
    if (static_cast<int64_t>(v.capacity()) < entries) v.reserve(static_cast<size_t>(2 * entries));
  };
  for (auto& parity : prefetched_) {
    reserve(parity[b].slots);
    reserve(parity[b].map);
  }
  reserve(chunks_[b].candidates.indices);
  reserve(selections_[b].indices);
}

absl::Status DecodeStep::PrefetchEnd(int next_layer) {
  StreamedKvCache& cache = *streamed_;
  const int64_t kv_heads = model_.config().num_kv_heads;
  if (!cache.addresses_only()) {
    ScopedTiming timing(Timing(&StepProfile::preselect));
    // Planned on the device: only what the policies said at launch (every row, none); the
    // launched choices stay where they are.
    if (!device_plan_) {
      CollectChoices(preselect_, [&](size_t b) -> Selection& { return chunks_[b].candidates; });
    }
    for (size_t b : preselect_.chunks) {
      if (preselect_.result[b] == BackendChoiceResult::kNone) chunks_[b].fetch = false;
      if (device_plan_ && preselect_.result[b] == BackendChoiceResult::kAll) {
        chunks_[b].candidates.all = true;
      }
    }
  }
  ScopedTiming timing(Timing(&StepProfile::prefetch));  // ends after the submission below
  // The batch's prefetches of this layer travel together.
  cache.BeginPrefetches();
  absl::Cleanup submit = [&cache] { cache.SubmitPrefetches(); };
  // Planned on the device, a prompt chunk's rows stored before it (ReadPromptRows) travel with
  // them.
  for (size_t b = 0; b < batch_.size() && device_plan_; ++b) {
    const ForwardChunk& chunk = batch_[b];
    if (chunk.tokens.size() == 1 || chunk.start == 0 || Failed(b)) continue;
    const absl::Status st = cache.PrefetchStored(chunk.seq, next_layer, chunk.start,
                                                 static_cast<int64_t>(chunk.tokens.size()));
    if (!st.ok()) FailKv(b, next_layer, st);
  }
  for (size_t b = 0; b < batch_.size(); ++b) {
    ChunkWork& w = chunks_[b];
    if (!w.fetch || Failed(b)) continue;
    Prefetched& pre = prefetched_[next_layer % 2][b];
    pre.on_device = false;
    if (device_plan_) {
      absl::StatusOr<bool> planned = PrefetchOnDevice(b, next_layer, w.stored);
      if (!planned.ok()) {
        FailKv(b, next_layer, planned.status());
        continue;
      }
      if (*planned) continue;
    }
    if (w.candidates.all) {  // dense: every stored row, in slot order
      EverySlot(kv_heads, w.stored, pre.slots);
      pre.count = w.stored;
    } else {
      pre.slots.swap(w.candidates.indices);  // both keep their capacity
      pre.count = w.candidates.count;
    }
    pre.dense = w.candidates.all;
    // One row per head is left free for the current token, which the step computes itself.
    const absl::Status st =
        cache.Prefetch(batch_[b].seq, next_layer, pre.slots.data(), pre.count, /*extra_rows=*/1,
                       /*placed=*/true);
    if (!st.ok()) {
      FailKv(b, next_layer, st);
      continue;
    }
    pre.layer = next_layer;
  }
  return absl::OkStatus();
}

}  // namespace infinigen
