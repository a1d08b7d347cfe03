// The InfiniGen selection policy (INFINIGEN.md, "Decode step"): layer i-1's attention input
// speculates layer i's attention scores against layer i's partial key cache (each stored key
// rotated by the skew and cut to the d' partial channels); a logit margin alpha decides how many
// tokens matter, and the group's predicted attention mass decides which.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"

namespace infinigen {

// The sidecar's skew A[:, P] of every layer in a backend's memory (float32 [kv_heads, d, p]
// each), uploaded once per model and shared by the policies that choose there.
struct PartialSkewOnBackend {
  Backend* backend = nullptr;
  int partial_dim = 0;
  std::vector<std::unique_ptr<Buffer>> layers;
};
absl::StatusOr<std::shared_ptr<const PartialSkewOnBackend>> UploadPartialSkew(
    const InfinigenSidecar& sidecar, Backend& backend);

// On the host (partial keys in host memory, scored there), or, where ChoosesOnBackend, in the
// memory of the backend `skew` lives in (infinigen_backend_policy.cc: the same choices, made by
// Backend::ChooseRows; the host reads back only the chosen rows).
absl::StatusOr<std::unique_ptr<KvSelectionPolicy>> MakeInfinigenPolicy(
    const SelectionConfig& config, const ModelConfig& model, const InfinigenSidecar& sidecar,
    std::shared_ptr<const PartialSkewOnBackend> skew = nullptr);

// Whether InfiniGen chooses in the memory of `skew`'s backend: one the host cannot read (a
// GPU), and a configuration its choice covers (a speculated query; no sinks or recent window).
bool ChoosesOnBackend(const SelectionConfig& config, const PartialSkewOnBackend* skew);
std::unique_ptr<KvSelectionPolicy> MakeInfinigenBackendPolicy(
    const SelectionConfig& config, const ModelConfig& model,
    std::shared_ptr<const PartialSkewOnBackend> skew);

}  // namespace infinigen
