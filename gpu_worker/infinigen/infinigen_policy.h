// The InfiniGen selection policy (INFINIGEN.md, "Decode step"): layer i-1's attention input
// speculates layer i's attention scores against layer i's partial key cache (each stored key
// rotated by the skew and cut to the d' partial channels); a logit margin alpha decides how many
// tokens matter, and the group's predicted attention mass decides which.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"

namespace infinigen {

absl::StatusOr<std::unique_ptr<KvSelectionPolicy>> MakeInfinigenPolicy(
    const SelectionConfig& config, const ModelConfig& model, const InfinigenSidecar& sidecar);

}  // namespace infinigen
