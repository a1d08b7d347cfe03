#include "gpu_worker/infinigen/prepare.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/infinigen/skew.h"
#include "gpu_worker/kv/backend_kv_cache.h"

namespace infinigen {
namespace {

// Sees every prefill row (via the selection-policy hook) and feeds the statistics.
class CalibrationObserver final : public KvSelectionPolicy {
 public:
  CalibrationObserver(const ModelConfig& c, const std::vector<std::vector<float>>* skews)
      : c_(c), skews_(skews), scale_(1.0f / std::sqrt(static_cast<float>(c.head_dim))) {
    for (int64_t l = 0; l < c.num_layers; ++l) {
      for (int64_t g = 0; g < c.num_kv_heads; ++g) {
        if (skews == nullptr) {
          grams_.emplace_back(static_cast<int>(c.head_dim));
        } else {
          std::vector<float> a((*skews)[l].begin() + g * c.head_dim * c.head_dim,
                               (*skews)[l].begin() + (g + 1) * c.head_dim * c.head_dim);
          scores_.emplace_back(static_cast<int>(c.head_dim), a);
        }
      }
    }
  }

  std::string Name() const override { return "calibration"; }
  absl::Status Select(const SelectRequest&, Selection& out) override {
    out.all = true;
    return absl::OkStatus();
  }

  absl::Status OnKeys(const LayerKeys& keys) override {
    const int64_t d = c_.head_dim, group = c_.num_heads / c_.num_kv_heads;
    std::vector<float> q_scaled(d);
    for (int64_t t = 0; t < keys.count; ++t) {
      const float* q = keys.q + t * keys.q_stride;
      const float* k = keys.k + t * keys.k_stride;
      for (int64_t g = 0; g < c_.num_kv_heads; ++g) {
        const size_t idx = static_cast<size_t>(keys.layer * c_.num_kv_heads + g);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          for (int64_t i = 0; i < d; ++i) q_scaled[i] = q[h * d + i] * scale_;
          if (skews_ == nullptr) {
            grams_[idx].Add(q_scaled.data());
          } else {
            scores_[idx].AddQuery(q_scaled.data());
          }
        }
        if (skews_ != nullptr) scores_[idx].AddKey(k + g * d);
      }
    }
    return absl::OkStatus();
  }

  const GramAccumulator& gram(int64_t layer, int64_t g) const {
    return grams_[layer * c_.num_kv_heads + g];
  }
  const ChannelScores& scores(int64_t layer, int64_t g) const {
    return scores_[layer * c_.num_kv_heads + g];
  }

 private:
  const ModelConfig& c_;
  const std::vector<std::vector<float>>* skews_;
  float scale_;
  std::vector<GramAccumulator> grams_;
  std::vector<ChannelScores> scores_;
};

absl::Status RunCalibration(Model& model, std::span<const int32_t> tokens, int64_t chunk,
                            KvSelectionPolicy& observer, int pass,
                            const PrepareProgress& progress) {
  BackendKvCache cache(model.backend(), model.kv_shape());
  const SequenceId seq = 1;
  IG_RETURN_IF_ERROR(cache.Open(seq, static_cast<int64_t>(tokens.size())));
  std::vector<float> logits(model.config().vocab_size);
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t pos = 0; pos < n; pos += chunk) {
    const int64_t len = std::min(chunk, n - pos);
    ForwardChunk c{seq, pos, tokens.subspan(pos, len), false, &observer};
    IG_RETURN_IF_ERROR(DecodeStep(model, cache).Forward({&c, 1}, logits));
    if (progress) progress(pass, pos + len, n);
  }
  cache.Close(seq);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<InfinigenSidecar> PrepareInfinigen(Model& model, const Checkpoint& checkpoint,
                                                  std::span<const int32_t> calibration,
                                                  const PrepareOptions& options,
                                                  const PrepareProgress& progress) {
  const ModelConfig& c = model.config();
  if (!(options.ratio >= 0.0f && options.ratio <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ratio must be in (0, 1] (or 0 for the default), got ", options.ratio));
  }
  const float ratio =
      options.ratio > 0.0f
          ? options.ratio
          : std::min(1.0f, static_cast<float>(kDefaultPartialChannels) / c.head_dim);
  if (calibration.size() < 2) {
    return absl::InvalidArgumentError("the calibration text has fewer than 2 tokens");
  }
  if (static_cast<int64_t>(calibration.size()) > c.max_position_embeddings) {
    calibration = calibration.subspan(0, c.max_position_embeddings);
  }
  if (options.chunk_tokens < 1) return absl::InvalidArgumentError("chunk_tokens must be >= 1");
  const int64_t chunk = options.chunk_tokens;

  const bool rope_pairs = options.rope_pairs && c.architecture == Architecture::kLlama &&
                          c.rope.rotary_dim == c.head_dim && c.head_dim % 2 == 0;
  InfinigenSidecar s;
  s.ratio = ratio;
  s.partial_dim = static_cast<int>(std::ceil(ratio * c.head_dim - 1e-6));
  if (rope_pairs) s.partial_dim = std::min<int>(s.partial_dim + s.partial_dim % 2, c.head_dim);
  s.skewed = options.skew && !rope_pairs;
  s.rope_pairs = rope_pairs;
  s.channel_rule = options.channel_rule == ChannelRule::kProduct ? "product" : "sum";
  s.model_fingerprint = ModelFingerprint(checkpoint);
  s.calibration_hash = Fnv1aHex(calibration.data(), calibration.size() * sizeof(int32_t));
  s.calibration_tokens = static_cast<int64_t>(calibration.size());
  s.num_layers = static_cast<int>(c.num_layers);
  s.num_kv_heads = static_cast<int>(c.num_kv_heads);
  s.head_dim = static_cast<int>(c.head_dim);
  const int64_t d = c.head_dim;

  // Pass 1: the skews (or identities for the ablation).
  s.skew.assign(c.num_layers, std::vector<float>(c.num_kv_heads * d * d, 0.0f));
  if (s.skewed) {
    CalibrationObserver grams(c, nullptr);
    IG_RETURN_IF_ERROR(RunCalibration(model, calibration, chunk, grams, 1, progress));
    for (int64_t l = 0; l < c.num_layers; ++l) {
      for (int64_t g = 0; g < c.num_kv_heads; ++g) {
        std::vector<float> a = SkewFromGram(grams.gram(l, g));
        std::copy(a.begin(), a.end(), s.skew[l].begin() + g * d * d);
      }
    }
  } else {
    for (auto& layer : s.skew) {
      for (int64_t g = 0; g < c.num_kv_heads; ++g) {
        for (int64_t i = 0; i < d; ++i) layer[g * d * d + i * d + i] = 1.0f;
      }
    }
  }
  // Pass 2: channel scores in the rotated space.
  CalibrationObserver scores(c, &s.skew);
  IG_RETURN_IF_ERROR(RunCalibration(model, calibration, chunk, scores, 2, progress));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::vector<int32_t> channels;
    for (int64_t g = 0; g < c.num_kv_heads; ++g) {
      auto top =
          rope_pairs
              ? scores.scores(l, g).TopPairs(
                    s.partial_dim, options.channel_rule,
                    [&](int ch) { return RopePartner(ch, c.rope.rotary_dim, c.rope.layout); })
              : scores.scores(l, g).Top(s.partial_dim, options.channel_rule);
      channels.insert(channels.end(), top.begin(), top.end());
    }
    s.channels.push_back(std::move(channels));
  }
  return s;
}

}  // namespace infinigen
