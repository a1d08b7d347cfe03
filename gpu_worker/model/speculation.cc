#include "gpu_worker/model/speculation.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen {

namespace {

// The RoPE pair index (the inv_freq entry) of channel c.
int PairIndex(int c, int rotary_dim, cpu::RopeLayout layout) {
  if (layout == cpu::RopeLayout::kInterleaved) return c / 2;
  const int half = rotary_dim / 2;
  return c < half ? c : c - half;
}

// Whether A[:, P] ([kv_heads, d, p]) only picks channels: column c of head g is the unit vector
// of channel channels[g * p + c] (an unskewed sidecar). Otherwise the speculation must multiply
// by A itself.
bool PicksChannels(const std::vector<float>& a, const std::vector<int32_t>& channels, int kv_heads,
                   int d, int p) {
  if (a.size() != static_cast<size_t>(kv_heads) * d * p) return false;
  for (int g = 0; g < kv_heads; ++g) {
    for (int i = 0; i < d; ++i) {
      for (int c = 0; c < p; ++c) {
        const float want = i == channels[static_cast<size_t>(g) * p + c] ? 1.0f : 0.0f;
        if (a[(static_cast<size_t>(g) * d + i) * p + c] != want) return false;
      }
    }
  }
  return true;
}

}  // namespace

Speculation::QueryWeights Speculation::FromCheckpoint(const Checkpoint& ckpt) {
  return [&ckpt](int layer, std::vector<float>& w, std::vector<float>& b) -> absl::Status {
    const ModelConfig& c = ckpt.config();
    const std::string name = absl::StrCat(
        c.architecture == Architecture::kLlama ? "model.layers." : "model.decoder.layers.", layer,
        ".self_attn.q_proj.");
    IG_ASSIGN_OR_RETURN(const StoredTensor* t,
                        ckpt.Get(name + "weight", {c.q_dim(), c.hidden_size}));
    w.resize(static_cast<size_t>(t->NumElements()));
    DecodeToFloat(*t, w.data());
    ckpt.DropPages(*t);
    b.clear();
    if (c.attention_bias) {
      IG_ASSIGN_OR_RETURN(b, ckpt.ReadFloat(name + "bias", {c.q_dim()}));
    }
    return absl::OkStatus();
  };
}

absl::StatusOr<std::unique_ptr<Speculation>> Speculation::Build(const ModelConfig& c,
                                                                const QueryWeights& query_weights,
                                                                const PartialChannels& pc,
                                                                const std::vector<float>& inv_freq,
                                                                Backend& backend) {
  const int kv_heads = static_cast<int>(c.num_kv_heads), heads = static_cast<int>(c.num_heads);
  const int d = static_cast<int>(c.head_dim), p = pc.partial_dim, group = heads / kv_heads;
  const int64_t hidden = c.hidden_size;
  if (p < 1 || p > d || static_cast<int64_t>(pc.partial_skew.size()) != c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("speculation: ", pc.partial_skew.size(),
                                                   " layers of partial channels of width ", p,
                                                   " for a model of ", c.num_layers, " layers"));
  }
  std::unique_ptr<Speculation> s(new Speculation(backend, c));
  s->partial_dim_ = p;
  const bool rope = c.architecture == Architecture::kLlama;
  bool pairs = rope && !pc.skewed && static_cast<int64_t>(pc.channels.size()) == c.num_layers;
  for (int64_t l = 0; pairs && l < c.num_layers; ++l) {
    pairs = IsRopePairOrder(pc.channels[l], kv_heads, p, d, c.rope.rotary_dim, c.rope.layout) &&
            PicksChannels(pc.partial_skew[l], pc.channels[l], kv_heads, d, p);
  }
  s->mode_ = !rope ? Mode::kFoldedQuery : pairs ? Mode::kRopePairs : Mode::kFullQuery;
  if (rope && static_cast<int>(inv_freq.size()) != c.rope.rotary_dim / 2) {
    return absl::InvalidArgumentError("speculation: the RoPE frequencies do not match the model");
  }
  const int out_dim = s->mode_ == Mode::kFullQuery ? d : p;  // rows per head of the weight
  s->macs_per_token_ = static_cast<int64_t>(heads) * out_dim * hidden +
                       (s->mode_ == Mode::kFullQuery ? static_cast<int64_t>(heads) * d * p : 0);
  s->qkv_macs_per_token_ = (c.q_dim() + 2 * c.kv_dim()) * hidden;

  auto upload_floats = [&](const std::vector<float>& v) -> absl::StatusOr<std::unique_ptr<Buffer>> {
    IG_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> b, backend.Allocate(v.size() * sizeof(float)));
    IG_RETURN_IF_ERROR(backend.CopyToDevice(v.data(), b->data(), v.size() * sizeof(float)));
    return b;
  };
  std::vector<float> wq, bq;
  std::vector<float> rows(static_cast<size_t>(heads) * out_dim * hidden), bias;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    IG_RETURN_IF_ERROR(query_weights(static_cast<int>(l), wq, bq));
    if (wq.size() != static_cast<size_t>(c.q_dim() * hidden) ||
        (!bq.empty() && bq.size() != static_cast<size_t>(c.q_dim()))) {
      return absl::InvalidArgumentError(absl::StrCat("speculation: layer ", l, "'s W_q has ",
                                                     wq.size(), " values, ", c.q_dim() * hidden,
                                                     " expected"));
    }
    const std::vector<float>& a = pc.partial_skew[l];  // [kv_heads, d, p]
    if (a.size() != static_cast<size_t>(kv_heads) * d * p) {
      return absl::InvalidArgumentError(
          absl::StrCat("speculation: layer ", l, "'s A[:, P] has ", a.size(), " values"));
    }
    Layer& L = s->layers_.emplace_back();
    bias.assign(bq.empty() ? 0 : static_cast<size_t>(heads) * out_dim, 0.0f);
    if (s->mode_ == Mode::kFullQuery) {
      rows = wq;
      bias = bq;
      IG_ASSIGN_OR_RETURN(L.partial_skew, upload_floats(a));
    } else {
      // Row h * p + c of the partial weight: kFoldedQuery folds A's column c into head h's
      // rows (sum_i A[i, c] W_q[h * d + i]), kRopePairs takes the row of channel P[c] itself.
      for (int h = 0; h < heads; ++h) {
        const int g = h / group;
        for (int col = 0; col < p; ++col) {
          float* dst = rows.data() + (static_cast<size_t>(h) * p + col) * hidden;
          if (s->mode_ == Mode::kRopePairs) {
            const int ch = pc.channels[l][static_cast<size_t>(g) * p + col];
            const float* src = wq.data() + (static_cast<size_t>(h) * d + ch) * hidden;
            std::copy(src, src + hidden, dst);
            if (!bias.empty()) bias[static_cast<size_t>(h) * p + col] = bq[h * d + ch];
            continue;
          }
          std::vector<double> acc(hidden, 0.0);
          double b = 0.0;
          for (int i = 0; i < d; ++i) {
            const double w = a[(static_cast<size_t>(g) * d + i) * p + col];
            if (w == 0.0) continue;
            const float* src = wq.data() + (static_cast<size_t>(h) * d + i) * hidden;
            for (int64_t k = 0; k < hidden; ++k) acc[k] += w * src[k];
            if (!bq.empty()) b += w * bq[h * d + i];
          }
          for (int64_t k = 0; k < hidden; ++k) dst[k] = static_cast<float>(acc[k]);
          if (!bias.empty()) bias[static_cast<size_t>(h) * p + col] = static_cast<float>(b);
        }
      }
    }
    IG_ASSIGN_OR_RETURN(
        L.weight, backend.UploadWeight(rows.data(), static_cast<int64_t>(heads) * out_dim, hidden));
    if (!bias.empty()) {
      IG_ASSIGN_OR_RETURN(L.bias,
                          backend.UploadWeight(bias.data(), 1, static_cast<int64_t>(bias.size())));
    }
    if (s->mode_ == Mode::kRopePairs) {
      // Head h's partial channels are m = p / 2 first members then their partners: a "half"
      // RoPE layout of width p whose pair i turns at the frequency of channel P[i]'s pair.
      const int m = p / 2;
      std::vector<float> freq(static_cast<size_t>(heads) * m);
      for (int h = 0; h < heads; ++h) {
        for (int i = 0; i < m; ++i) {
          const int ch = pc.channels[l][static_cast<size_t>(h / group) * p + i];
          freq[static_cast<size_t>(h) * m + i] =
              inv_freq[PairIndex(ch, c.rope.rotary_dim, c.rope.layout)];
        }
      }
      IG_ASSIGN_OR_RETURN(L.inv_freq, upload_floats(freq));
    }
  }
  if (s->mode_ == Mode::kFullQuery && rope) {
    IG_ASSIGN_OR_RETURN(s->positions_inv_freq_, upload_floats(inv_freq));
  }
  return s;
}

absl::Status Speculation::Run(int layer, MatView input, const int32_t* positions, MatView scratch,
                              MatView out) const {
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("speculation of layer ", layer));
  }
  const Layer& L = layers_[layer];
  const Weight* bias = L.bias ? &L.bias : nullptr;
  const int heads = static_cast<int>(config_.num_heads);
  const int d = static_cast<int>(config_.head_dim), p = partial_dim_;
  switch (mode_) {
    case Mode::kFoldedQuery:
      return backend_.Linear(input, L.weight, bias, out, false);
    case Mode::kRopePairs:
      IG_RETURN_IF_ERROR(backend_.Linear(input, L.weight, bias, out, false));
      return backend_.Rope(out, heads, p, p, positions,
                           static_cast<const float*>(L.inv_freq->data()), cpu::RopeLayout::kHalf,
                           /*inv_freq_head_stride=*/p / 2);
    case Mode::kFullQuery:
      IG_RETURN_IF_ERROR(backend_.Linear(input, L.weight, bias, scratch, false));
      IG_RETURN_IF_ERROR(backend_.Rope(scratch, heads, d, config_.rope.rotary_dim, positions,
                                       static_cast<const float*>(positions_inv_freq_->data()),
                                       config_.rope.layout));
      return backend_.ProjectHeads(scratch, heads, static_cast<int>(config_.num_kv_heads), d,
                                   static_cast<const float*>(L.partial_skew->data()), p, out);
  }
  return absl::OkStatus();
}

}  // namespace infinigen
