// `infinigen prepare`: the offline skewing of INFINIGEN.md. A dense prefill of a calibration
// text collects, per layer and KV head, the Gram matrix of the group's (post-RoPE, 1/sqrt(d)
// scaled) query rows; its eigenvectors are the skew A. A second prefill scores the rotated
// channels by Σ|Q·A| + Σ|K·A| and keeps the top d' = ceil(r·d).
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "absl/status/statusor.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/infinigen/skew.h"
#include "gpu_worker/model/model.h"

namespace infinigen {

// Partial channels kept when no ratio is given: the paper's r = 0.2 at head_dim 128, i.e. 26
// channels, whatever the head size (r = 0.4 at head_dim 64). docs/accuracy.md measures why: at
// r = 0.2 a 64-wide head keeps 13 channels and the speculation misses the heads' best rows.
inline constexpr int kDefaultPartialChannels = 26;

struct PrepareOptions {
  float ratio = 0.0f;  // 0: kDefaultPartialChannels / head_dim (capped at 1)
  bool skew = true;    // false: A = I (ablation)
  // Product ranks channels by mean|QA| x mean|KA| (what a channel adds to Q.K); docs/accuracy.md
  // compares it with the paper's sum.
  ChannelRule channel_rule = ChannelRule::kProduct;
  // Partial channels as whole RoPE pairs, not skewed, where the model allows (Llama with RoPE
  // over whole heads; otherwise ignored): the speculation then needs only those rows of W_q
  // (Speculation::Mode::kRopePairs) instead of the whole Q projection, and on SmolLM2 predicts
  // as well as the skewed channels (docs/accuracy.md). The channel count rounds up to even.
  bool rope_pairs = true;
  int64_t chunk_tokens = 512;  // prefill chunk size
};

// Called as calibration advances: pass (1 or 2), tokens done, tokens in all.
using PrepareProgress = std::function<void(int pass, int64_t done, int64_t total)>;

absl::StatusOr<InfinigenSidecar> PrepareInfinigen(Model& model, const Checkpoint& checkpoint,
                                                  std::span<const int32_t> calibration,
                                                  const PrepareOptions& options,
                                                  const PrepareProgress& progress = {});

}  // namespace infinigen
