// The InfiniGen sidecar and a model: attaching it (the speculation's weights), identifying the
// model it belongs to, and where it lives. Its file format: sidecar_file.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/infinigen/sidecar_file.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"

namespace infinigen {

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

// ParseSidecar of the file at `path` for `model` (its fingerprint and shape).
absl::StatusOr<InfinigenSidecar> ReadSidecar(const std::string& path, const Checkpoint& model);

}  // namespace infinigen
