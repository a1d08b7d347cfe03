#include "gpu_worker/infinigen/infinigen_policy.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gpu_worker/infinigen/selection_util.h"
#include "kernels/cpu/selection.h"

namespace infinigen {
namespace {

// Work (heads x rows) below which a layer's choice stays on the calling thread, and (smaller)
// below which its scoring does: a 4K-token sequence of a 9-head model scores on every core.
constexpr int64_t kParallelRows = 1 << 16;
constexpr int64_t kParallelScores = 1 << 13;
// Rows scored together per query head (accumulators on the stack).
constexpr int64_t kRowBlock = cpu::kScoreBlock;
// Rows per chunk of the partial key cache: a growing sequence adds chunks and never copies
// what it has (a copy of every layer's partial keys used to stall the first decode step).
constexpr int64_t kChunkRows = 1024;
static_assert(kChunkRows % kRowBlock == 0, "a block of scored rows lies in one chunk");
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
    scores_.reserve(static_cast<size_t>(model_.num_heads) * rows);
    mass_.reserve(static_cast<size_t>(model_.num_kv_heads) * rows);
    for (Prescored& p : prescored_) p.scores.reserve(static_cast<size_t>(model_.num_heads) * rows);
    forced_.resize(model_.num_kv_heads);
    for (auto& f : forced_) f.reserve(rows + 1);
    q_partial_.reserve(static_cast<size_t>(model_.num_heads) * partial_dim_);
    head_counts_.reserve(static_cast<size_t>(model_.num_heads));
    for (Prescored& p : prescored_) {
      p.q_partial.reserve(static_cast<size_t>(model_.num_heads) * partial_dim_);
    }
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
#pragma omp parallel for schedule(static) if (keys.count >= 64)
    for (int64_t t = 0; t < keys.count; ++t) {
      float partial[kMaxPartialDim];
      for (int g = 0; g < kv_heads; ++g) {
        const int32_t slot = keys.slots[t * kv_heads + g];
        cpu::ProjectPartial(keys.k + t * keys.k_stride + g * d,
                            skew + static_cast<size_t>(g) * d * p, d, p, partial);
        for (int c = 0; c < p; ++c) *cache.Rows(slot, g, c, p) = FloatToBf16(partial[c]);
      }
    }
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
    const int64_t k = Score(r, query, /*partial=*/!actual, n, k_max, /*keep=*/false);
    if (k >= n) {
      out.all = true;
      return absl::OkStatus();
    }
    Choose(r, n, k, /*with_current=*/true, out);
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
    const int64_t counted = Score(r, r.speculated_q, /*partial=*/true, n, k_max, /*keep=*/true);
    const int64_t k = std::min(n, counted + PrefetchMargin(counted));
    if (k >= n) {
      out.all = true;
      return true;
    }
    Choose(r, n, k, /*with_current=*/false, out);
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
  // Speculated scores s[h, j] = (q_h · A_g[:, P]) · K̃_g[j] / sqrt(d) of rows [0, n) into
  // scores_ (`partial`: `query` is q~ = q_h · A_g[:, P] already, [heads, p]; else the whole
  // query, projected here); returns k: the mean over heads of the rows within alpha of the head's
  // best, clamped to [max(min_tokens, min_budget_tokens), k_max]. `keep`: remember the scores, so
  // that the layer's own Select (the same query, one more row) scores only the new rows; the
  // reused scores are the same floats it would compute (each row's dot product is summed in
  // channel order, whichever block of rows it is scored in). KV heads in parallel.
  int64_t Score(const SelectRequest& r, const float* query, bool partial, int64_t n, int64_t k_max,
                bool keep) {
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
    scores_.resize(static_cast<size_t>(heads) * n);
    head_counts_.assign(heads, 0);
    const float margin = static_cast<float>(config_.alpha);
    for (int h = 0; h < heads; ++h) {
      std::copy_n(pre.scores.data() + static_cast<size_t>(h) * reuse, reuse,
                  scores_.data() + static_cast<size_t>(h) * n);
    }
    // Blocks of rows of every KV head in parallel (a few KV heads would leave cores idle), each
    // row's score summed in channel order whichever block it falls in.
    // Blocks aligned to kRowBlock (so that none crosses a chunk of the partial key cache), the
    // first one starting at `reuse`.
    const int64_t first_block = reuse / kRowBlock;
    const int64_t blocks = n > reuse ? (n + kRowBlock - 1) / kRowBlock - first_block : 0;
#pragma omp parallel for schedule(static) if (heads * (n - reuse) >= kParallelScores)
    for (int64_t t = 0; t < blocks * kv_heads; ++t) {
      const int g = static_cast<int>(t % kv_heads);
      const int64_t b = first_block + t / kv_heads;
      const int64_t j0 = std::max(reuse, b * kRowBlock);
      const int64_t rows = std::min(n, (b + 1) * kRowBlock) - j0;
      for (int h = g * group; h < (g + 1) * group; ++h) {
        // Channel c of this block's rows at Rows(j0, g, c, p): kChunkRows apart.
        cpu::ScorePartialBlock(q_partial_.data() + static_cast<size_t>(h) * p,
                               cache.Rows(j0, g, 0, p), kChunkRows, rows, p, scale,
                               scores_.data() + static_cast<size_t>(h) * n + j0);
      }
    }
    for (int h = 0; h < heads; ++h) {
      head_counts_[h] = cpu::AlphaCount(scores_.data() + static_cast<size_t>(h) * n, n, margin);
    }
    if (keep) {
      pre.seq = r.seq;  // field by field: the vectors keep their capacity
      pre.layer = r.layer;
      pre.n = n;
      pre.q_partial.assign(q_partial_.begin(), q_partial_.end());
      pre.scores.assign(scores_.begin(), scores_.end());
    } else {
      pre.layer = -1;
    }
    return cpu::BudgetFromCounts(head_counts_,
                                 std::max(config_.min_tokens, config_.min_budget_tokens), k_max);
  }

  // The top k rows per KV head by the group's predicted attention mass (from scores_), the
  // current token (when asked) and the always-kept rows first. KV heads in parallel.
  void Choose(const SelectRequest& r, int64_t n, int64_t k, bool with_current, Selection& out) {
    const int heads = static_cast<int>(model_.num_heads);
    const int kv_heads = static_cast<int>(model_.num_kv_heads);
    GroupAttentionMass(scores_.data(), heads, kv_heads, n, mass_);
    forced_.resize(kv_heads);
    for (int g = 0; g < kv_heads; ++g) {
      forced_[g].clear();
      if (with_current) forced_[g].push_back(r.current_slots[g]);
      AddAlwaysKept(r, g, n, forced_[g]);
    }
    out.all = false;
    out.count = k;
    out.indices.resize(static_cast<size_t>(kv_heads) * k);
#pragma omp parallel for schedule(static) if (kv_heads * n >= kParallelRows)
    for (int g = 0; g < kv_heads; ++g) {
      TopK(mass_.data() + static_cast<size_t>(g) * n, n, k, forced_[g],
           out.indices.data() + static_cast<size_t>(g) * k);
    }
  }

  // Partial keys of one (sequence, layer) in chunks of kChunkRows rows, each channel-major:
  // [kv_heads][p][kChunkRows], so that scoring a block of rows reads each channel contiguously
  // (vectorized over the rows). bfloat16: scoring every stored row is bound by reading them, and
  // half the bytes measured the same selections (docs/accuracy.md).
  struct PartialKeys {
    std::vector<std::unique_ptr<uint16_t[]>> chunks;
    int64_t capacity() const { return static_cast<int64_t>(chunks.size()) * kChunkRows; }
    // Channel c of KV head g from row `row` to the end of its chunk.
    uint16_t* Rows(int64_t row, int g, int c, int p) {
      return chunks[static_cast<size_t>(row / kChunkRows)].get() +
             (static_cast<size_t>(g) * p + c) * kChunkRows + row % kChunkRows;
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
  std::vector<float> scores_, mass_, q_partial_;
  std::vector<int64_t> head_counts_;
  std::vector<std::vector<int32_t>> forced_;  // per KV head, for Choose
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
    return MakeInfinigenBackendPolicy(config, model, std::move(skew));
  }
  return std::unique_ptr<KvSelectionPolicy>(new InfinigenPolicy(config, model, sidecar));
}

}  // namespace infinigen
