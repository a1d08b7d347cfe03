#include "gpu_worker/infinigen/infinigen_policy.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gpu_worker/infinigen/selection_util.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/selection.h"

namespace infinigen {
namespace {

// Rows scored together per query head (accumulators on the stack).
constexpr int64_t kRowBlock = cpu::kScoreBlock;
// Rows per chunk of the partial key cache: a growing sequence adds chunks and never copies
// what it has (a copy of every layer's partial keys used to stall the first decode step).
constexpr int64_t kChunkRows = 1024;
static_assert(kChunkRows % kRowBlock == 0, "a block of scored rows lies in one chunk");
static_assert(kChunkRows % cpu::kScoreLanes == 0, "a group of lanes lies in one chunk");
// The widest partial key: d' = ceil(ratio x head_dim) with head_dim <= 256.
constexpr int kMaxPartialDim = 256;

class InfinigenPolicy final : public KvSelectionPolicy {
 public:
  InfinigenPolicy(const SelectionConfig& config, const ModelConfig& model,
                  const InfinigenSidecar& sidecar)
      : config_(config), model_(model), partial_dim_(sidecar.partial_dim) {
    for (int l = 0; l < model.num_layers; ++l) partial_skew_.push_back(sidecar.PartialSkew(l));
  }

  std::string Name() const override { return "infinigen"; }
  SpeculationInput speculation_input() const override {
    return config_.speculation == SpeculationInput::kActualQuery ? SpeculationInput::kNone
                                                                 : config_.speculation;
  }
  bool SpeculatesFor(int layer) const override {
    return speculation_input() != SpeculationInput::kNone && layer >= config_.dense_layers;
  }

  // Room for the whole sequence: its partial keys, slot positions and this policy's scratch.
  void Open(SequenceId seq, int64_t capacity_tokens) override {
    positions_.Reserve(seq, static_cast<int>(model_.num_layers),
                       static_cast<int>(model_.num_kv_heads), capacity_tokens);
    auto& layers = partial_[seq];
    if (static_cast<int>(layers.size()) < model_.num_layers) layers.resize(model_.num_layers);
    for (int l = config_.dense_layers; l < model_.num_layers; ++l) {
      // Uninitialized: the pages are committed as rows are written, not at admission (a long
      // max_new_tokens need not hold memory it never uses); every row scored was written first.
      Reserve(layers[l], capacity_tokens, /*zero=*/false);
    }
    const size_t rows = static_cast<size_t>(capacity_tokens);
    scratch_.Reserve(static_cast<int>(model_.num_heads), static_cast<int>(model_.num_kv_heads),
                     capacity_tokens);
    for (Prescored& p : prescored_) p.scores.reserve(static_cast<size_t>(model_.num_heads) * rows);
    forced_.resize(model_.num_kv_heads);
    for (auto& f : forced_) f.reserve(rows + 1);
    q_partial_.reserve(static_cast<size_t>(model_.num_heads) * partial_dim_);
    for (Prescored& p : prescored_) {
      p.q_partial.reserve(static_cast<size_t>(model_.num_heads) * partial_dim_);
    }
  }

  // What Open reserves: the partial keys of every sparse layer (whole chunks), every layer's
  // slot positions, and this policy's scratch (a request's policy serves one sequence).
  size_t HostBytesFor(int64_t capacity_tokens) const override {
    const int64_t rows = std::max<int64_t>(capacity_tokens, 0);
    const size_t heads = static_cast<size_t>(model_.num_heads),
                 kv_heads = static_cast<size_t>(model_.num_kv_heads);
    const size_t sparse = static_cast<size_t>(
        std::max<int64_t>(0, model_.num_layers - std::max(config_.dense_layers, 0)));
    const size_t chunks = static_cast<size_t>((rows + kChunkRows - 1) / kChunkRows);
    const size_t n = static_cast<size_t>(rows);
    return sparse * chunks * kv_heads * partial_dim_ * kChunkRows * sizeof(uint16_t) +
           static_cast<size_t>(model_.num_layers) * kv_heads * n * sizeof(int64_t) +
           cpu::ChoiceScratch::Bytes(static_cast<int>(heads), static_cast<int>(kv_heads), rows) +
           2 * heads * n * sizeof(float) + kv_heads * (n + 1) * sizeof(int32_t);
  }

  // Rotates and cuts every new key of a sparse layer into the partial key cache, at its slot.
  absl::Status OnKeys(const LayerKeys& keys) override {
    positions_.Record(keys, static_cast<int>(model_.num_kv_heads));
    if (keys.layer < config_.dense_layers) return absl::OkStatus();
    auto& layers = partial_[keys.seq];
    if (static_cast<int>(layers.size()) < model_.num_layers) layers.resize(model_.num_layers);
    PartialKeys& cache = layers[keys.layer];
    const int kv_heads = static_cast<int>(model_.num_kv_heads);
    const int d = static_cast<int>(model_.head_dim), p = partial_dim_;
    Prescored& pre = prescored_[keys.layer % 2];
    int32_t max_slot = -1;
    for (int64_t i = 0; i < keys.count * kv_heads; ++i) {
      const int32_t slot = keys.slots[i];
      max_slot = std::max(max_slot, slot);
      if (pre.seq == keys.seq && pre.layer == keys.layer && slot < pre.n) pre.layer = -1;
    }
    Reserve(cache, max_slot + 1);
    const float* skew = partial_skew_[keys.layer].data();
    cpu::ParallelFor(keys.count, keys.count >= 64, [&](int64_t t) {
      float partial[kMaxPartialDim];
      for (int g = 0; g < kv_heads; ++g) {
        const int32_t slot = keys.slots[t * kv_heads + g];
        cpu::ProjectPartial(keys.k + t * keys.k_stride + g * d,
                            skew + static_cast<size_t>(g) * d * p, d, p, partial);
        for (int c = 0; c < p; ++c) *cache.Rows(slot, g, c, p) = FloatToBf16(partial[c]);
      }
    });
    return absl::OkStatus();
  }

  absl::Status Select(const SelectRequest& r, Selection& out) override {
    const int64_t n = r.kv.num_slots;
    const int64_t k_max = config_.Budget(n);
    if (r.layer < config_.dense_layers || n <= config_.min_budget_tokens) {
      out.all = true;
      return absl::OkStatus();
    }
    const bool actual = config_.speculation == SpeculationInput::kActualQuery;
    const float* query = actual ? r.q : r.speculated_q;
    if (query == nullptr) {
      return absl::InternalError("infinigen: the model did not provide a speculated query");
    }
    Rank(r, query, /*partial=*/!actual, n, k_max, /*prefetch=*/false, out);
    return absl::OkStatus();
  }

  // Candidates for the prefetch of layer r.layer, chosen during the previous layer before the
  // current token's key exists: the same speculated scores over the n stored rows, ranked the
  // same way, as many as the alpha threshold counts there (clamped to the budget) plus a margin
  // (PrefetchMargin), so that the exact selection made at the layer itself (which also scores
  // the current token, and may count one row more) is nearly always among them. The threshold
  // thereby decides the bytes moved, not only the rows attended.
  bool Preselect(const SelectRequest& r, Selection& out) override {
    const int64_t n = r.kv.num_slots;  // stored rows, the current token not among them
    if (n <= 0) return false;
    if (r.layer < config_.dense_layers) {
      out.all = true;
      return true;
    }
    if (r.speculated_q == nullptr || config_.speculation == SpeculationInput::kActualQuery) {
      return false;
    }
    const int64_t k_max = config_.Budget(n + 1);
    if (k_max > n) {  // everything: the layer reads all rows anyway
      out.all = true;
      return true;
    }
    Rank(r, r.speculated_q, /*partial=*/true, n, k_max, /*prefetch=*/true, out);
    return true;
  }

  void Release(SequenceId seq) override {
    partial_.erase(seq);
    positions_.Release(seq);
  }

 private:
  // Rows prefetched beyond the alpha count of the stored rows: one for the count the current
  // token may add, and a share for rows whose rank changes once the current token joins the
  // softmax of each head (measured: docs/accuracy.md, "Rows moved").
  static int64_t PrefetchMargin(int64_t counted) { return cpu::PrefetchMargin(counted); }
  // InfiniGen's choice over rows [0, n), its phases the team's loops of
  // kernels/cpu/selection.h:
  // - speculated scores s[h, j] = (q_h · A_g[:, P]) · K̃_g[j] / sqrt(d) into scratch_.scores
  //   (`partial`: `query` is q~ = q_h · A_g[:, P] already, [heads, p]; else the whole query,
  //   projected here);
  // - k: the mean over heads of the rows within alpha of the head's best, clamped to
  //   [max(min_tokens, min_budget_tokens), k_max]; for a `prefetch` plus PrefetchMargin;
  // - per KV head the top k rows by the group's predicted attention mass, the current token
  //   (unless `prefetch`) and the always-kept rows first; every row (out.all) when k >= n.
  // A `prefetch` keeps its scores, so that the layer's own Select (the same query, one more row)
  // scores only the new rows; the reused scores are the same floats it would compute (each
  // row's dot product is summed in channel order, whichever block of rows it is scored in).
  void Rank(const SelectRequest& r, const float* query, bool partial, int64_t n, int64_t k_max,
            bool prefetch, Selection& out) {
    const int heads = static_cast<int>(model_.num_heads);
    const int kv_heads = static_cast<int>(model_.num_kv_heads);
    const int group = heads / kv_heads;
    const int d = static_cast<int>(model_.head_dim), p = partial_dim_;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    auto& layers = partial_[r.seq];
    if (static_cast<int>(layers.size()) < model_.num_layers) layers.resize(model_.num_layers);
    PartialKeys& cache = layers[r.layer];
    Reserve(cache, n);  // rows never stored read as zeros
    const float* skew = partial_skew_[r.layer].data();
    q_partial_.resize(static_cast<size_t>(heads) * p);
    for (int h = 0; h < heads && !partial; ++h) {
      cpu::ProjectPartial(query + static_cast<size_t>(h) * d,
                          skew + static_cast<size_t>(h / group) * d * p, d, p,
                          q_partial_.data() + static_cast<size_t>(h) * p);
    }
    if (partial) std::copy_n(query, q_partial_.size(), q_partial_.begin());
    Prescored& pre = prescored_[r.layer % 2];
    const int64_t reuse =
        pre.seq == r.seq && pre.layer == r.layer && pre.n <= n && pre.q_partial == q_partial_
            ? pre.n
            : 0;
    scratch_.Size(heads, kv_heads, n);
    for (int h = 0; h < heads; ++h) {
      std::copy_n(pre.scores.data() + static_cast<size_t>(h) * reuse, reuse,
                  scratch_.scores.data() + static_cast<size_t>(h) * n);
    }
    forced_.resize(kv_heads);
    for (int g = 0; g < kv_heads; ++g) {
      forced_[g].clear();
      if (!prefetch) forced_[g].push_back(r.current_slots[g]);
      AddAlwaysKept(r, g, n, forced_[g]);
    }
    // Tiled (kScoreBlock-aligned blocks never cross a chunk).
    const auto keys_at = [&cache, p](int64_t j0, int g) {
      return cpu::PartialKeyLayout{cache.Rows(j0, g, 0, p), cpu::kScoreLanes, p * cpu::kScoreLanes};
    };
    cpu::RowChoice c;
    c.num_heads = heads;
    c.num_kv_heads = kv_heads;
    c.partial_dim = p;
    c.scale = scale;
    c.alpha = static_cast<float>(config_.alpha);
    c.rows = n;
    c.k_min = std::max(config_.min_tokens, config_.min_budget_tokens);
    c.k_max = k_max;
    cpu::Choose(c, q_partial_.data(), reuse, keys_at, forced_.data(), scratch_, [&](int64_t k) {
      if (prefetch) k = std::min(n, k + PrefetchMargin(k));
      if (prefetch) {
        pre.seq = r.seq;  // field by field: the vectors keep their capacity
        pre.layer = r.layer;
        pre.n = n;
        pre.q_partial.assign(q_partial_.begin(), q_partial_.end());
        pre.scores.assign(scratch_.scores.begin(), scratch_.scores.end());
      } else {
        pre.layer = -1;
      }
      out.all = k >= n;
      if (out.all) return cpu::ChoiceTarget{};
      out.count = k;
      out.indices.resize(static_cast<size_t>(kv_heads) * k);
      return cpu::ChoiceTarget{k, out.indices.data(), k};
    });
  }

  // Partial keys of one (sequence, layer) in chunks of kChunkRows rows, each tiled per KV head:
  // [kv_heads][kChunkRows / kScoreLanes][p][kScoreLanes], so that scoring a group of rows reads
  // one run of memory (a channel-major chunk, each channel kChunkRows apart, had each group of
  // rows touch p lines 2 KiB apart: they conflict in the L1 and defeat the prefetcher).
  // bfloat16: scoring every stored row is bound by reading them, and half the bytes measured
  // the same selections (docs/accuracy.md).
  struct PartialKeys {
    std::vector<std::unique_ptr<uint16_t[]>> chunks;
    int64_t capacity() const { return static_cast<int64_t>(chunks.size()) * kChunkRows; }
    // Channel c of KV head g at row `row`.
    uint16_t* Rows(int64_t row, int g, int c, int p) {
      const int64_t in_chunk = row % kChunkRows;
      return chunks[static_cast<size_t>(row / kChunkRows)].get() +
             static_cast<size_t>(g) * p * kChunkRows +
             (in_chunk / cpu::kScoreLanes * p + c) * cpu::kScoreLanes + in_chunk % cpu::kScoreLanes;
    }
  };
  // Room for `slots` rows; new rows are zeros (uninitialized with `zero` false).
  void Reserve(PartialKeys& keys, int64_t slots, bool zero = true) const {
    const size_t floats = static_cast<size_t>(model_.num_kv_heads) * partial_dim_ * kChunkRows;
    while (keys.capacity() < slots) {
      keys.chunks.push_back(zero ? std::make_unique<uint16_t[]>(floats)  // value-initialized
                                 : std::unique_ptr<uint16_t[]>(new uint16_t[floats]));
    }
  }

  // Optional attention sinks and recent window (default off, as in the paper).
  void AddAlwaysKept(const SelectRequest& r, int g, int64_t n, std::vector<int32_t>& forced) const {
    if (config_.sink_tokens == 0 && config_.recent_tokens == 0) return;
    const auto& pos = positions_.Of(r.seq, r.layer, g);
    for (int32_t j = 0; j < n && j < static_cast<int32_t>(pos.size()); ++j) {
      if (pos[j] < config_.sink_tokens || pos[j] > r.position - config_.recent_tokens) {
        forced.push_back(j);
      }
    }
  }

  SelectionConfig config_;
  const ModelConfig& model_;
  int partial_dim_;
  std::vector<std::vector<float>> partial_skew_;  // [layer] -> [kv_heads, d, p]
  absl::flat_hash_map<SequenceId, std::vector<PartialKeys>> partial_;  // seq -> [layer]
  SlotPositions positions_;
  cpu::ChoiceScratch scratch_;
  std::vector<float> q_partial_;
  std::vector<std::vector<int32_t>> forced_;  // per KV head, for Rank
  // The scores a Preselect computed for layer `layer` ([heads, n]), per layer parity (the
  // next layer's Preselect may come before this layer's Select).
  struct Prescored {
    SequenceId seq = 0;
    int layer = -1;
    int64_t n = 0;
    std::vector<float> q_partial, scores;
  };
  Prescored prescored_[2];
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvSelectionPolicy>> MakeInfinigenPolicy(
    const SelectionConfig& config, const ModelConfig& model, const InfinigenSidecar& sidecar,
    std::shared_ptr<const PartialSkewOnBackend> skew) {
  if (sidecar.num_layers != model.num_layers || sidecar.num_kv_heads != model.num_kv_heads ||
      sidecar.head_dim != model.head_dim) {
    return absl::FailedPreconditionError("the InfiniGen sidecar does not match the model's shape");
  }
  if (sidecar.partial_dim < 1 ||
      sidecar.partial_dim > std::min<int64_t>(model.head_dim, kMaxPartialDim)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the InfiniGen sidecar's partial dimension ", sidecar.partial_dim,
                     " is outside [1, ", std::min<int64_t>(model.head_dim, kMaxPartialDim), "]"));
  }
  if (ChoosesOnBackend(config, skew.get())) {
    if (skew->partial_dim != sidecar.partial_dim ||
        skew->layers.size() != size_t(model.num_layers)) {
      return absl::FailedPreconditionError("the skew on the backend is not this sidecar's");
    }
    if (absl::Status s = skew->backend->CheckRowChoiceShape(model.num_heads, model.num_kv_heads,
                                                            static_cast<int>(sidecar.partial_dim));
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("the InfiniGen sidecar does not fit this "
                                                 "backend's row choice: ",
                                                 s.message()));
    }
    return MakeInfinigenBackendPolicy(config, model, std::move(skew));
  }
  return std::unique_ptr<KvSelectionPolicy>(new InfinigenPolicy(config, model, sidecar));
}

}  // namespace infinigen
