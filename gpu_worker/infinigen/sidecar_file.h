// The InfiniGen sidecar: what `infinigen prepare` computes for a model, saved next to it as a
// versioned safetensors file. Per layer and KV head: the skew A (d x d, orthogonal) and the
// partial channels P (d' of them); plus metadata that ties it to the model and calibration.
// Writing and parsing it need no model, only its fingerprint and shape (the parser is fuzzed:
// tests/fuzz/sidecar_fuzz.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mapped_file.h"
#include "gpu_worker/model/config.h"

namespace infinigen {

struct InfinigenSidecar {
  static constexpr int kFormatVersion = 1;

  float ratio = 0.2f;   // partial ratio r
  int partial_dim = 0;  // d' = ceil(r * d)
  bool skewed = true;   // false: A = I (the paper's "no skewing" ablation)
  // The channels are whole RoPE pairs in Speculation's kRopePairs order (unskewed): the
  // speculation multiplies only their rows of W_q.
  bool rope_pairs = false;
  std::string channel_rule;  // how the partial channels were ranked ("sum", "product"; "" unknown)
  std::string model_fingerprint;
  std::string calibration_hash;
  int64_t calibration_tokens = 0;
  int num_layers = 0, num_kv_heads = 0, head_dim = 0;
  std::vector<std::vector<float>> skew;        // [layer] -> [kv_heads, d, d]
  std::vector<std::vector<int32_t>> channels;  // [layer] -> [kv_heads, partial_dim]

  // A[:, P] for every KV head of `layer`: [kv_heads, d, partial_dim], row-major.
  std::vector<float> PartialSkew(int layer) const;
};

absl::Status WriteSidecar(const InfinigenSidecar& sidecar, const std::string& path);
// The sidecar in `file` (named `where` in errors) for the model with `model_fingerprint` and
// shape `model`: FAILED_PRECONDITION with the reason when it belongs to another model or format
// version, or any part of it is malformed (shapes, channels out of range, RoPE pairs that are
// not this model's); `model_path` goes into the advice to prepare it again.
absl::StatusOr<InfinigenSidecar> ParseSidecar(const MappedFile& file, const std::string& where,
                                              const std::string& model_fingerprint,
                                              const ModelConfig& model,
                                              const std::string& model_path);

}  // namespace infinigen
