// The InfiniGen sidecar: what `infinigen prepare` computes for a model, saved next to it as a
// versioned safetensors file. Per layer and KV head: the skew A (d x d, orthogonal) and the
// partial channels P (d' of them); plus metadata that ties it to the model and calibration.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"

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

// The sidecar's partial channels as the model's speculation takes them.
PartialChannels PartialChannelsOf(const InfinigenSidecar& sidecar);
// Builds `model`'s speculation weights from the sidecar (Model::AttachSpeculation): needed
// before any InfiniGen policy of this sidecar runs on the model.
absl::Status AttachSidecar(Model& model, const Checkpoint& checkpoint,
                           const InfinigenSidecar& sidecar);

// Identifies a checkpoint: its shape and a hash of the first layer's query weights.
std::string ModelFingerprint(const Checkpoint& checkpoint);
// A stable 64-bit FNV-1a hash as 16 hex digits.
std::string Fnv1aHex(const void* data, size_t bytes);

// Where a model's sidecar lives by default: "<file>.infinigen.safetensors" next to a GGUF, or
// "infinigen.safetensors" inside a Hugging Face folder.
std::string DefaultSidecarPath(const std::string& model_path);

absl::Status WriteSidecar(const InfinigenSidecar& sidecar, const std::string& path);
// FAILED_PRECONDITION with the reason when the sidecar belongs to another model or version.
absl::StatusOr<InfinigenSidecar> ReadSidecar(const std::string& path, const Checkpoint& model);

}  // namespace infinigen
