// LayerAttention: what the layer loop asks of whoever owns the K/V (the decode step,
// gpu_worker/engine/decode_step.h). The model computes projections, norms and MLPs; which rows a
// token attends to, where they come from and how they get there is behind this seam.
#pragma once

#include "absl/status/status.h"
#include "gpu_worker/backend/backend.h"

namespace infinigen {

class LayerAttention {
 public:
  virtual ~LayerAttention() = default;

  // Layer `layer` is about to compute its Q/K/V from `attention_input` ([tokens, hidden]: the
  // normalized input of pre-norm models, the residual itself otherwise); `residual` is the
  // residual stream it came from. Valid until Attend of the same layer returns.
  virtual absl::Status BeforeLayer(int layer, MatView attention_input, MatView residual) = 0;
  // Attention of layer `layer`: q [tokens, num_heads * head_dim], k and v [tokens, num_kv_heads
  // * head_dim] (after RoPE) of the batch's new tokens; writes out [tokens, num_heads *
  // head_dim].
  virtual absl::Status Attend(int layer, MatView q, MatView k, MatView v, MatView out) = 0;
};

}  // namespace infinigen
