// The selection policies: full (dense), window (sinks + recent, StreamingLLM), H2O (heavy
// hitters + recent with eviction), oracle (exact top-k by true attention), and the factory.
// InfiniGen itself is in infinigen_policy.cc.
#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/selection_util.h"
#include "kernels/cpu/serial_blas.h"

namespace infinigen {
namespace {

class FullPolicy final : public KvSelectionPolicy {
 public:
  std::string Name() const override { return "full"; }
  absl::Status Select(const SelectRequest&, Selection& out) override {
    out.all = true;
    return absl::OkStatus();
  }
};

// Base for policies that need the model's shape and the slot -> position map.
class PositionalPolicy : public KvSelectionPolicy {
 public:
  PositionalPolicy(const SelectionConfig& config, const ModelConfig& model)
      : config_(config), model_(model) {}
  void Open(SequenceId seq, int64_t capacity_tokens) override {
    positions_.Reserve(seq, static_cast<int>(model_.num_layers),
                       static_cast<int>(model_.num_kv_heads), capacity_tokens);
    order_.reserve(static_cast<size_t>(capacity_tokens));
  }
  absl::Status OnKeys(const LayerKeys& keys) override {
    positions_.Record(keys, static_cast<int>(model_.num_kv_heads));
    return absl::OkStatus();
  }
  void Release(SequenceId seq) override { positions_.Release(seq); }

 protected:
  bool Dense(const SelectRequest& r, Selection& out) const {
    if (r.layer >= config_.dense_layers && config_.Budget(r.kv.num_slots) < r.kv.num_slots) {
      return false;
    }
    out.all = true;
    return true;
  }
  // Slots of one head ordered by position, oldest first (into order_, reused).
  const std::vector<int32_t>& ByPosition(SequenceId seq, int layer, int head, int64_t n) {
    const auto& pos = positions_.Of(seq, layer, head);
    order_.resize(static_cast<size_t>(n));
    for (int32_t j = 0; j < n; ++j) order_[j] = j;
    std::sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
      const int64_t pa = a < static_cast<int32_t>(pos.size()) ? pos[a] : a;
      const int64_t pb = b < static_cast<int32_t>(pos.size()) ? pos[b] : b;
      return pa < pb;
    });
    return order_;
  }

  SelectionConfig config_;
  const ModelConfig& model_;
  SlotPositions positions_;
  std::vector<int32_t> order_;
};

class WindowPolicy final : public PositionalPolicy {
 public:
  using PositionalPolicy::PositionalPolicy;
  std::string Name() const override { return "window"; }
  absl::Status Select(const SelectRequest& r, Selection& out) override {
    if (Dense(r, out)) return absl::OkStatus();
    const int64_t n = r.kv.num_slots, k = config_.Budget(n);
    const int64_t sinks = std::min(config_.sink_tokens, k - 1);
    out.all = false;
    out.count = k;
    out.indices.resize(static_cast<size_t>(model_.num_kv_heads) * k);
    for (int g = 0; g < model_.num_kv_heads; ++g) {
      const std::vector<int32_t>& order = ByPosition(r.seq, r.layer, g, n);
      int32_t* chosen = out.indices.data() + static_cast<size_t>(g) * k;
      std::copy(order.begin(), order.begin() + sinks, chosen);
      std::copy(order.end() - (k - sinks), order.end(), chosen + sinks);
      std::sort(chosen, chosen + k);
    }
    return absl::OkStatus();
  }
};

// Heavy-Hitter Oracle (Zhang et al., NeurIPS'23): keeps the budget's worth of rows with the
// largest accumulated attention plus a recent window, and evicts the rest for good.
class H2oPolicy final : public PositionalPolicy {
 public:
  using PositionalPolicy::PositionalPolicy;
  std::string Name() const override { return "h2o"; }
  bool wants_attention_weights() const override { return true; }
  bool needs_resident_kv() const override { return true; }

  absl::Status OnKeys(const LayerKeys& keys) override {
    IG_RETURN_IF_ERROR(PositionalPolicy::OnKeys(keys));
    State& s = state_[keys.seq];
    if (static_cast<int>(s.layers.size()) <= keys.layer) s.layers.resize(keys.layer + 1);
    Layer& l = s.layers[keys.layer];
    const int kv_heads = static_cast<int>(model_.num_kv_heads);
    if (l.heads.empty()) l.heads.resize(kv_heads);
    for (int64_t t = 0; t < keys.count; ++t) {
      for (int g = 0; g < kv_heads; ++g) {
        Head& h = l.heads[g];
        const int32_t slot = keys.slots[t * kv_heads + g];
        if (static_cast<int32_t>(h.score.size()) <= slot) h.score.resize(slot + 1, 0.0f);
        h.score[slot] = 0.0f;
        h.retained.push_back(slot);
      }
    }
    if (keys.count > 1) AccumulatePrefill(keys, l);
    return absl::OkStatus();
  }

  absl::Status Select(const SelectRequest& r, Selection& out) override {
    if (r.layer < config_.dense_layers) {
      out.all = true;
      return absl::OkStatus();
    }
    Layer& l = state_[r.seq].layers[r.layer];
    const int64_t k = config_.Budget(r.kv.num_slots);
    const int64_t recent = std::max<int64_t>(1, std::llround(k * config_.h2o_recent_fraction));
    out.all = false;
    out.indices.clear();
    int64_t count = -1;
    for (int g = 0; g < model_.num_kv_heads; ++g) {
      Head& h = l.heads[g];
      const auto& pos = positions_.Of(r.seq, r.layer, g);
      auto position = [&](int32_t slot) { return pos[slot]; };
      // Evict the lowest accumulated score outside the recent window until the budget holds.
      std::sort(h.retained.begin(), h.retained.end(),
                [&](int32_t a, int32_t b) { return position(a) < position(b); });
      while (static_cast<int64_t>(h.retained.size()) > k) {
        const int64_t candidates = static_cast<int64_t>(h.retained.size()) - recent;
        auto victim =
            std::min_element(h.retained.begin(), h.retained.begin() + candidates,
                             [&](int32_t a, int32_t b) { return h.score[a] < h.score[b]; });
        h.retained.erase(victim);
      }
      std::vector<int32_t> sorted = h.retained;
      std::sort(sorted.begin(), sorted.end());
      if (count < 0) count = static_cast<int64_t>(sorted.size());
      // Heads of a layer evict in step (same arrivals, same budget), so counts agree.
      if (static_cast<int64_t>(sorted.size()) != count) {
        return absl::InternalError("h2o: KV heads retained different numbers of rows");
      }
      out.indices.insert(out.indices.end(), sorted.begin(), sorted.end());
    }
    out.count = count;
    return absl::OkStatus();
  }

  void OnAttentionWeights(SequenceId seq, int layer, const Selection& selection,
                          const float* weights, int64_t rows) override {
    if (selection.all) return;
    Layer& l = state_[seq].layers[layer];
    const int group = static_cast<int>(model_.num_heads / model_.num_kv_heads);
    for (int h = 0; h < model_.num_heads; ++h) {
      Head& head = l.heads[h / group];
      const int32_t* idx = selection.indices.data() + (h / group) * rows;
      for (int64_t j = 0; j < rows; ++j) head.score[idx[j]] += weights[h * rows + j];
    }
  }

  void Release(SequenceId seq) override {
    PositionalPolicy::Release(seq);
    state_.erase(seq);
  }

 private:
  struct Head {
    std::vector<float> score;       // [slot] accumulated attention mass
    std::vector<int32_t> retained;  // slots not evicted
  };
  struct Layer {
    std::vector<Head> heads;
  };
  struct State {
    std::vector<Layer> layers;
  };

  // Prefill queries' attention over the prompt, summed per key: H2O's initial scores.
  void AccumulatePrefill(const LayerKeys& keys, Layer& l) {
    const int d = static_cast<int>(model_.head_dim);
    const int group = static_cast<int>(model_.num_heads / model_.num_kv_heads);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const int64_t ctx = keys.start + keys.count;
    std::vector<float> s(static_cast<size_t>(keys.count) * ctx);
    const KvView& k = keys.kv.k;
    std::vector<float> widened;  // a KV head's keys as float32 when they are stored as bf16
    for (int h = 0; h < model_.num_heads; ++h) {
      const int g = h / group;
      const float* kh = static_cast<const float*>(k.data) + g * k.head_stride;
      int64_t ldk = k.row_stride;
      if (k.dtype == DType::kBF16) {
        widened.resize(static_cast<size_t>(ctx) * d);
        const uint16_t* src = static_cast<const uint16_t*>(k.data) + g * k.head_stride;
        for (int64_t j = 0; j < ctx; ++j) {
          for (int c = 0; c < d; ++c) widened[j * d + c] = Bf16ToFloat(src[j * k.row_stride + c]);
        }
        kh = widened.data();
        ldk = d;
      }
      cpu::SerialBlas();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, keys.count, ctx, d, scale,
                  keys.q + h * d, keys.q_stride, kh, ldk, 0.0f, s.data(), ctx);
      Head& head = l.heads[g];
      for (int64_t t = 0; t < keys.count; ++t) {
        float* row = s.data() + t * ctx;
        const int64_t visible = keys.start + t + 1;
        const float mx = *std::max_element(row, row + visible);
        double sum = 0;
        for (int64_t j = 0; j < visible; ++j) sum += (row[j] = std::exp(row[j] - mx));
        for (int64_t j = 0; j < visible; ++j) head.score[j] += static_cast<float>(row[j] / sum);
      }
    }
  }

  absl::flat_hash_map<SequenceId, State> state_;
};

// The upper bound: the exact top-k rows by true attention mass (summed over a group's heads).
class OraclePolicy final : public PositionalPolicy {
 public:
  bool needs_resident_kv() const override { return true; }
  using PositionalPolicy::PositionalPolicy;
  std::string Name() const override { return "oracle"; }
  absl::Status Select(const SelectRequest& r, Selection& out) override {
    if (Dense(r, out)) return absl::OkStatus();
    const int64_t n = r.kv.num_slots, k = config_.Budget(n);
    ExactScores(r.q, r.kv, static_cast<int>(model_.num_heads),
                static_cast<int>(model_.num_kv_heads), static_cast<int>(model_.head_dim),
                1.0f / std::sqrt(static_cast<float>(model_.head_dim)), scores_);
    GroupAttentionMass(scores_.data(), static_cast<int>(model_.num_heads),
                       static_cast<int>(model_.num_kv_heads), n, mass_);
    out.all = false;
    out.count = k;
    out.indices.clear();
    for (int g = 0; g < model_.num_kv_heads; ++g) {
      TopK(mass_.data() + g * n, n, k, {r.current_slots[g]}, out.indices);
    }
    return absl::OkStatus();
  }

 private:
  std::vector<float> scores_, mass_;
};

}  // namespace

const char* PolicyKindName(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kFull:
      return "full";
    case PolicyKind::kInfinigen:
      return "infinigen";
    case PolicyKind::kH2o:
      return "h2o";
    case PolicyKind::kWindow:
      return "window";
    case PolicyKind::kOracle:
      return "oracle";
  }
  return "?";
}

absl::StatusOr<PolicyKind> ParsePolicyKind(absl::string_view name) {
  for (PolicyKind k : {PolicyKind::kFull, PolicyKind::kInfinigen, PolicyKind::kH2o,
                       PolicyKind::kWindow, PolicyKind::kOracle}) {
    if (name == PolicyKindName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown selection policy '", name, "': expected full, infinigen, h2o, window or oracle"));
}

int64_t SelectionConfig::Budget(int64_t stored) const {
  const int64_t k = budget_tokens > 0
                        ? budget_tokens
                        : static_cast<int64_t>(std::ceil(budget_fraction * stored - 1e-9));
  return std::clamp<int64_t>(std::max(k, min_budget_tokens), 1, stored);
}

absl::Status SelectionConfig::Validate() const {
  if (dense_layers < 1) {
    return absl::InvalidArgumentError(
        "dense_layers must be >= 1 (layer 0 has nothing to speculate from)");
  }
  if (budget_tokens < 0 || !(budget_fraction > 0.0 && budget_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        "budget_fraction must be in (0, 1] and budget_tokens >= 0 (0 = use the fraction)");
  }
  if (min_tokens < 1 || sink_tokens < 0 || recent_tokens < 0 || min_budget_tokens < 0) {
    return absl::InvalidArgumentError(
        "min_tokens must be >= 1, min_budget_tokens, sink and recent tokens >= 0");
  }
  if (!(alpha > 0.0)) return absl::InvalidArgumentError("alpha must be > 0");
  if (!(h2o_recent_fraction > 0.0 && h2o_recent_fraction < 1.0)) {
    return absl::InvalidArgumentError("h2o_recent_fraction must be in (0, 1)");
  }
  return absl::OkStatus();
}

absl::StatusOr<SelectionConfig> ApplyOverrides(const SelectionConfig& defaults,
                                               const SelectionOverrides& o,
                                               const SelectionLimits& limits) {
  SelectionConfig c = defaults;
  if (o.policy.has_value()) {
    if (std::find(limits.allowed_policies.begin(), limits.allowed_policies.end(), *o.policy) ==
        limits.allowed_policies.end()) {
      std::string allowed;
      for (PolicyKind k : limits.allowed_policies) {
        absl::StrAppend(&allowed, allowed.empty() ? "" : ", ", PolicyKindName(k));
      }
      return absl::InvalidArgumentError(
          absl::StrCat("selection policy '", PolicyKindName(*o.policy),
                       "' is not allowed on this server (", allowed, " are)"));
    }
    c.policy = *o.policy;
  }
  if (o.budget_fraction.has_value()) {
    if (!(*o.budget_fraction >= limits.min_budget_fraction &&
          *o.budget_fraction <= limits.max_budget_fraction)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "KV budget fraction ", *o.budget_fraction, " is outside this server's limits [",
          limits.min_budget_fraction, ", ", limits.max_budget_fraction, "]"));
    }
    c.budget_fraction = *o.budget_fraction;
    c.budget_tokens = 0;
  }
  if (o.alpha.has_value()) {
    if (!(*o.alpha >= limits.min_alpha && *o.alpha <= limits.max_alpha)) {
      return absl::InvalidArgumentError(
          absl::StrCat("InfiniGen alpha ", *o.alpha, " is outside this server's limits [",
                       limits.min_alpha, ", ", limits.max_alpha, "]"));
    }
    c.alpha = *o.alpha;
  }
  IG_RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::StatusOr<std::unique_ptr<KvSelectionPolicy>> MakeSelectionPolicy(
    const SelectionConfig& config, const ModelConfig& model, const InfinigenSidecar* sidecar,
    std::shared_ptr<const PartialSkewOnBackend> skew) {
  IG_RETURN_IF_ERROR(config.Validate());
  switch (config.policy) {
    case PolicyKind::kFull:
      return std::unique_ptr<KvSelectionPolicy>(new FullPolicy());
    case PolicyKind::kWindow: {
      SelectionConfig c = config;
      if (c.sink_tokens == 0) c.sink_tokens = 4;  // StreamingLLM's attention sinks
      return std::unique_ptr<KvSelectionPolicy>(new WindowPolicy(c, model));
    }
    case PolicyKind::kH2o:
      return std::unique_ptr<KvSelectionPolicy>(new H2oPolicy(config, model));
    case PolicyKind::kOracle:
      return std::unique_ptr<KvSelectionPolicy>(new OraclePolicy(config, model));
    case PolicyKind::kInfinigen:
      break;
  }
  if (sidecar == nullptr) {
    return absl::FailedPreconditionError(
        "the infinigen policy needs the model's sidecar: run `infinigen prepare --model ...`");
  }
  return MakeInfinigenPolicy(config, model, *sidecar, std::move(skew));
}

}  // namespace infinigen
