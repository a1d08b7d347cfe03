// One InfiniGen decode step against a plainly written double-precision reference of the whole
// step (INFINIGEN.md "Decode step"): a random Llama checkpoint with 6 layers (speculation runs
// for layers 2-5), GQA 3:1 and head_dim 10 (not a power of two), a prompt, then one decode
// token through the product's DecodeStep with the InfiniGen policy over the resident cache.
// The reference recomputes everything in double from the checkpoint's tensors: the dense
// prefill, layer i-1's normalized attention input, the partial query RoPE(W_q x) . A[:, P] and
// the partial keys K . A[:, P], the scores, the per-head alpha count and the sequence's k, the
// group attention mass, the per-KV-head top-k (current token forced, ties to the lower slot) and
// attention over the chosen rows. The product must choose exactly the same rows at every layer
// and give the same logits within float32 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/model/safetensors.h"
#include "tests/support/fixture_model.h"

namespace infinigen {
namespace {

constexpr int kLayers = 6, kHidden = 48, kHeads = 9, kKvHeads = 3, kHeadDim = 10;
constexpr int kInter = 40, kVocab = 64, kPrompt = 70;
constexpr double kTheta = 10000.0, kEps = 1e-5;
constexpr int kDenseLayers = 2;
constexpr double kBudget = 0.3, kAlpha = 3.0;

using Mat = std::vector<double>;  // row-major

// The random checkpoint as doubles, and written as a Hugging Face folder.
struct Weights {
  Mat embed, final_norm, lm_head;
  struct Layer {
    Mat attn_norm, q, k, v, o, mlp_norm, gate, up, down;
  };
  std::vector<Layer> layers;
};

Mat Random(std::mt19937& rng, size_t n, double scale) {
  std::normal_distribution<double> d(0.0, scale);
  Mat m(n);
  for (double& x : m) x = static_cast<float>(d(rng));  // representable in float32
  return m;
}

Weights MakeWeights() {
  std::mt19937 rng(17);
  Weights w;
  w.embed = Random(rng, kVocab * kHidden, 1.0);
  w.final_norm = Random(rng, kHidden, 0.1);
  for (double& x : w.final_norm) x = static_cast<float>(1.0 + x);
  w.lm_head = Random(rng, kVocab * kHidden, 0.3);
  for (int l = 0; l < kLayers; ++l) {
    Weights::Layer L;
    L.attn_norm = Random(rng, kHidden, 0.1);
    L.mlp_norm = Random(rng, kHidden, 0.1);
    for (double& x : L.attn_norm) x = static_cast<float>(1.0 + x);
    for (double& x : L.mlp_norm) x = static_cast<float>(1.0 + x);
    L.q = Random(rng, kHeads * kHeadDim * kHidden, 0.35);
    L.k = Random(rng, kKvHeads * kHeadDim * kHidden, 0.35);
    L.v = Random(rng, kKvHeads * kHeadDim * kHidden, 0.2);
    L.o = Random(rng, kHidden * kHeads * kHeadDim, 0.1);
    L.gate = Random(rng, kInter * kHidden, 0.2);
    L.up = Random(rng, kInter * kHidden, 0.2);
    L.down = Random(rng, kHidden * kInter, 0.1);
    w.layers.push_back(std::move(L));
  }
  return w;
}

void WriteCheckpoint(const Weights& w, const std::string& dir) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
  "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 6,
  "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 10,
  "max_position_embeddings": 256, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "tie_word_embeddings": false, "vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2
})";
  auto f = [](const Mat& m) { return std::vector<float>(m.begin(), m.end()); };
  std::vector<SafetensorsEntry> t = {{"model.embed_tokens.weight", {kVocab, kHidden}, f(w.embed)},
                                     {"model.norm.weight", {kHidden}, f(w.final_norm)},
                                     {"lm_head.weight", {kVocab, kHidden}, f(w.lm_head)}};
  for (int l = 0; l < kLayers; ++l) {
    const auto& L = w.layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {kHidden}, f(L.attn_norm)});
    t.push_back({p + "post_attention_layernorm.weight", {kHidden}, f(L.mlp_norm)});
    t.push_back({p + "self_attn.q_proj.weight", {kHeads * kHeadDim, kHidden}, f(L.q)});
    t.push_back({p + "self_attn.k_proj.weight", {kKvHeads * kHeadDim, kHidden}, f(L.k)});
    t.push_back({p + "self_attn.v_proj.weight", {kKvHeads * kHeadDim, kHidden}, f(L.v)});
    t.push_back({p + "self_attn.o_proj.weight", {kHidden, kHeads * kHeadDim}, f(L.o)});
    t.push_back({p + "mlp.gate_proj.weight", {kInter, kHidden}, f(L.gate)});
    t.push_back({p + "mlp.up_proj.weight", {kInter, kHidden}, f(L.up)});
    t.push_back({p + "mlp.down_proj.weight", {kHidden, kInter}, f(L.down)});
  }
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", t, {}).ok());
}

// y = W x for W [rows, cols].
Mat MatVec(const Mat& w, const Mat& x, int rows, int cols) {
  Mat y(rows, 0.0);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) y[r] += w[r * cols + c] * x[c];
  }
  return y;
}

Mat RmsNorm(const Mat& x, const Mat& w) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / x.size() + kEps);
  Mat y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

// RoPE of every head of `x` (heads of kHeadDim, "half" pairs (i, i + d/2)) at `pos`; the angle
// in float32 as Hugging Face computes it.
void Rope(Mat& x, int heads, int pos) {
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < kHeadDim / 2; ++i) {
      const float inv_freq = static_cast<float>(1.0 / std::pow(kTheta, 2.0 * i / kHeadDim));
      const double angle = static_cast<float>(pos) * inv_freq;
      double& a = x[h * kHeadDim + i];
      double& b = x[h * kHeadDim + i + kHeadDim / 2];
      const double a0 = a, b0 = b;
      a = a0 * std::cos(angle) - b0 * std::sin(angle);
      b = b0 * std::cos(angle) + a0 * std::sin(angle);
    }
  }
}

struct Reference {
  // Per sparse layer of the decode step: the chosen rows of each KV head, ascending.
  std::vector<std::vector<std::vector<int32_t>>> chosen;  // [layer][g] -> rows
  Mat logits;                                             // of the decode token
};

// The prompt densely, then the decode token `next` with InfiniGen, all in double.
Reference RunReference(const Weights& w, const InfinigenSidecar& s,
                       const std::vector<int32_t>& prompt, int32_t next) {
  const int group = kHeads / kKvHeads, p = s.partial_dim;
  const int n_tokens = static_cast<int>(prompt.size()) + 1;
  std::vector<int32_t> ids = prompt;
  ids.push_back(next);
  // K (post-RoPE) and V of every token, layer, KV head.
  std::vector<std::vector<Mat>> K(kLayers), V(kLayers);
  std::vector<Mat> x(n_tokens);
  for (int t = 0; t < n_tokens; ++t)
    x[t].assign(w.embed.begin() + ids[t] * kHidden, w.embed.begin() + (ids[t] + 1) * kHidden);
  Reference ref;
  ref.chosen.resize(kLayers);
  Mat prev_input;  // the decode token's normalized attention input at the previous layer
  for (int l = 0; l < kLayers; ++l) {
    const auto& L = w.layers[l];
    std::vector<Mat> q(n_tokens), out(n_tokens);
    K[l].resize(n_tokens);
    V[l].resize(n_tokens);
    Mat decode_input;
    for (int t = 0; t < n_tokens; ++t) {
      const Mat h = RmsNorm(x[t], L.attn_norm);
      if (t == n_tokens - 1) decode_input = h;
      q[t] = MatVec(L.q, h, kHeads * kHeadDim, kHidden);
      K[l][t] = MatVec(L.k, h, kKvHeads * kHeadDim, kHidden);
      V[l][t] = MatVec(L.v, h, kKvHeads * kHeadDim, kHidden);
      Rope(q[t], kHeads, t);
      Rope(K[l][t], kKvHeads, t);
    }
    const double scale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));
    // The rows each token attends per KV head: all before it, except the decode token at a
    // sparse layer, whose rows InfiniGen chooses.
    std::vector<std::vector<int32_t>> rows(kKvHeads);
    const int t_dec = n_tokens - 1, n = n_tokens;
    for (auto& r : rows) {
      r.resize(n);
      for (int j = 0; j < n; ++j) r[j] = j;
    }
    const int64_t k_max =
        std::clamp<int64_t>(static_cast<int64_t>(std::ceil(kBudget * n - 1e-9)), 1, n);
    if (l >= kDenseLayers && k_max < n) {
      const std::vector<float> a = s.PartialSkew(l);  // [kv, d, p]
      // Speculated partial query from the previous layer's normalized input.
      Mat qs = MatVec(L.q, prev_input, kHeads * kHeadDim, kHidden);
      Rope(qs, kHeads, t_dec);
      std::vector<Mat> scores(kHeads, Mat(n));
      double count_sum = 0;
      for (int h = 0; h < kHeads; ++h) {
        const int g = h / group;
        for (int j = 0; j < n; ++j) {
          double dot = 0;
          for (int c = 0; c < p; ++c) {
            double qc = 0, kc = 0;
            for (int i = 0; i < kHeadDim; ++i) {
              const double aic = a[(g * kHeadDim + i) * p + c];
              qc += qs[h * kHeadDim + i] * aic;
              kc += K[l][j][g * kHeadDim + i] * aic;
            }
            dot += qc * kc;
          }
          scores[h][j] = dot * scale;
        }
        const double best = *std::max_element(scores[h].begin(), scores[h].end());
        for (int j = 0; j < n; ++j) count_sum += scores[h][j] > best - kAlpha ? 1 : 0;
      }
      const int64_t k = std::clamp<int64_t>(std::llround(count_sum / kHeads), 1, k_max);
      if (k < n) {
        for (int g = 0; g < kKvHeads; ++g) {
          Mat mass(n, 0.0);
          for (int h = g * group; h < (g + 1) * group; ++h) {
            const double best = *std::max_element(scores[h].begin(), scores[h].end());
            double sum = 0;
            for (int j = 0; j < n; ++j) sum += std::exp(scores[h][j] - best);
            for (int j = 0; j < n; ++j) mass[j] += std::exp(scores[h][j] - best) / sum;
          }
          // The current token, then the heaviest others (ties to the lower slot).
          std::vector<int32_t> order;
          for (int j = 0; j < n; ++j) {
            if (j != t_dec) order.push_back(j);
          }
          std::stable_sort(order.begin(), order.end(),
                           [&](int32_t x1, int32_t x2) { return mass[x1] > mass[x2]; });
          order.resize(k - 1);
          order.push_back(t_dec);
          std::sort(order.begin(), order.end());
          rows[g] = order;
        }
        ref.chosen[l] = rows;
      }
    }
    for (int t = 0; t < n_tokens; ++t) {
      out[t].assign(kHeads * kHeadDim, 0.0);
      for (int h = 0; h < kHeads; ++h) {
        const int g = h / group;
        std::vector<int32_t> seen;
        if (t == t_dec) {
          seen = rows[g];
        } else {
          for (int j = 0; j <= t; ++j) seen.push_back(j);
        }
        Mat sc(seen.size());
        double best = -INFINITY, sum = 0;
        for (size_t j = 0; j < seen.size(); ++j) {
          double dot = 0;
          for (int i = 0; i < kHeadDim; ++i) {
            dot += q[t][h * kHeadDim + i] * K[l][seen[j]][g * kHeadDim + i];
          }
          sc[j] = dot * scale;
          best = std::max(best, sc[j]);
        }
        for (double& v : sc) sum += (v = std::exp(v - best));
        for (size_t j = 0; j < seen.size(); ++j) {
          for (int i = 0; i < kHeadDim; ++i) {
            out[t][h * kHeadDim + i] += sc[j] / sum * V[l][seen[j]][g * kHeadDim + i];
          }
        }
      }
      const Mat o = MatVec(L.o, out[t], kHidden, kHeads * kHeadDim);
      for (int i = 0; i < kHidden; ++i) x[t][i] += o[i];
      const Mat h2 = RmsNorm(x[t], L.mlp_norm);
      const Mat gate = MatVec(L.gate, h2, kInter, kHidden), up = MatVec(L.up, h2, kInter, kHidden);
      Mat act(kInter);
      for (int i = 0; i < kInter; ++i) act[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      const Mat down = MatVec(L.down, act, kHidden, kInter);
      for (int i = 0; i < kHidden; ++i) x[t][i] += down[i];
    }
    prev_input = decode_input;
  }
  ref.logits = MatVec(w.lm_head, RmsNorm(x[n_tokens - 1], w.final_norm), kVocab, kHidden);
  return ref;
}

// Records the selections the product's InfiniGen policy makes at the decode token.
class Recording final : public KvSelectionPolicy {
 public:
  explicit Recording(KvSelectionPolicy& inner) : inner_(inner) {}
  std::string Name() const override { return inner_.Name(); }
  SpeculationInput speculation_input() const override { return inner_.speculation_input(); }
  bool SpeculatesFor(int layer) const override { return inner_.SpeculatesFor(layer); }
  void Open(SequenceId seq, int64_t capacity) override { inner_.Open(seq, capacity); }
  absl::Status OnKeys(const LayerKeys& keys) override { return inner_.OnKeys(keys); }
  absl::Status Select(const SelectRequest& r, Selection& out) override {
    absl::Status st = inner_.Select(r, out);
    if (st.ok() && !out.all) {
      if (static_cast<int>(chosen.size()) <= r.layer) chosen.resize(r.layer + 1);
      chosen[r.layer].clear();
      for (int g = 0; g < kKvHeads; ++g) {
        chosen[r.layer].emplace_back(out.indices.begin() + g * out.count,
                                     out.indices.begin() + (g + 1) * out.count);
      }
    }
    return st;
  }
  void Release(SequenceId seq) override { inner_.Release(seq); }
  std::vector<std::vector<std::vector<int32_t>>> chosen;

 private:
  KvSelectionPolicy& inner_;
};

TEST(InfinigenReference, ADecodeStepChoosesTheReferencesRowsAndLogits) {
  const Weights w = MakeWeights();
  const std::string dir = ::testing::TempDir() + "/infinigen_reference_llama";
  WriteCheckpoint(w, dir);
  testing::LoadedModel l = testing::LoadModel(dir);
  ASSERT_NE(l.model, nullptr);
  for (bool rope_pairs : {true, false}) {
    SCOPED_TRACE(rope_pairs ? "whole RoPE pairs" : "skewed channels");
    PrepareOptions po;
    po.ratio = 0.6f;
    po.rope_pairs = rope_pairs;
    po.chunk_tokens = 32;
    auto sidecar = PrepareInfinigen(*l.model, *l.ckpt, testing::RandomTokens(96, kVocab, 3), po);
    ASSERT_TRUE(sidecar.ok()) << sidecar.status();
    ASSERT_TRUE(AttachSidecar(*l.model, *l.ckpt, *sidecar).ok());
    SelectionConfig config;
    config.policy = PolicyKind::kInfinigen;
    config.dense_layers = kDenseLayers;
    config.budget_fraction = kBudget;
    config.alpha = kAlpha;
    auto inner = MakeSelectionPolicy(config, l.model->config(), &*sidecar);
    ASSERT_TRUE(inner.ok()) << inner.status();
    Recording policy(**inner);

    const std::vector<int32_t> prompt = testing::RandomTokens(kPrompt, kVocab, 11);
    BackendKvCache cache(*l.backend, l.model->kv_shape());
    ASSERT_TRUE(cache.Open(1, kPrompt + 1).ok());
    policy.Open(1, kPrompt + 1);
    DecodeStep step(*l.model, cache);
    std::vector<float> logits(kVocab);
    ForwardChunk c{1, 0, prompt, false, &policy};
    ASSERT_TRUE(step.Forward({&c, 1}, logits).ok());
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    ForwardChunk d{1, kPrompt, std::span<const int32_t>(&next, 1), false, &policy};
    ASSERT_TRUE(step.Forward({&d, 1}, logits).ok());

    const Reference ref = RunReference(w, *sidecar, prompt, next);
    int sparse = 0;
    for (int layer = kDenseLayers; layer < kLayers; ++layer) {
      const auto got = layer < static_cast<int>(policy.chosen.size())
                           ? policy.chosen[layer]
                           : std::vector<std::vector<int32_t>>{};
      EXPECT_EQ(got, ref.chosen[layer]) << "layer " << layer;
      sparse += !ref.chosen[layer].empty();
    }
    EXPECT_EQ(sparse, kLayers - kDenseLayers) << "every speculated layer chose a subset";
    double scale = 0;
    for (double v : ref.logits) scale = std::max(scale, std::abs(v));
    for (int i = 0; i < kVocab; ++i) {
      EXPECT_NEAR(logits[i], ref.logits[i], 2e-4 * scale) << "logit " << i;
    }
    cache.Close(1);
    policy.Release(1);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace infinigen
