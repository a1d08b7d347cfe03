#include "cli/loaded_model.h"

#include "common/status_macros.h"
#include "gpu_worker/backend/cpu_backend.h"

namespace infinigen::cli {

absl::StatusOr<LoadedModel> LoadModel(const std::string& path, int threads) {
  LoadedModel m;
  IG_ASSIGN_OR_RETURN(m.checkpoint, Checkpoint::Open(path));
  m.backend = std::make_unique<CpuBackend>(CpuBackendOptions{threads});
  IG_ASSIGN_OR_RETURN(m.model, Model::Load(*m.checkpoint, *m.backend));
  return m;
}

}  // namespace infinigen::cli
