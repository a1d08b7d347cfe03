// A model checkpoint opened for reading: a Hugging Face folder (config.json + one or more
// .safetensors files) or a GGUF file. Files are memory-mapped; tensors are found by their
// Hugging Face names whatever the format.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/mapped_file.h"
#include "gpu_worker/model/config.h"
#include "gpu_worker/model/gguf.h"
#include "gpu_worker/model/stored_tensor.h"

namespace infinigen {

class Checkpoint {
 public:
  // `path`: a folder with config.json and model.safetensors (or a sharded
  // model.safetensors.index.json), or a .gguf file.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  const ModelConfig& config() const { return config_; }
  // The parsed GGUF (metadata, tokenizer) when the checkpoint is one; null otherwise.
  const GgufFile* gguf() const { return gguf_ ? &*gguf_ : nullptr; }

  const StoredTensor* Find(absl::string_view name) const;
  // The tensor `name`, which must have exactly `shape`; errors name the file and the tensor.
  absl::StatusOr<const StoredTensor*> Get(absl::string_view name,
                                          const std::vector<int64_t>& shape) const;
  // Decodes tensor `name` (of `shape`) to float32.
  absl::StatusOr<std::vector<float>> ReadFloat(absl::string_view name,
                                               const std::vector<int64_t>& shape) const;
  // Advises the kernel that the tensor's file pages are no longer needed (after conversion).
  void DropPages(const StoredTensor& t) const;

  std::vector<std::string> TensorNames() const;

 private:
  Checkpoint() = default;
  absl::Status OpenHfFolder(const std::string& dir);
  absl::Status OpenGguf(const std::string& file);
  absl::Status AddTensors(std::vector<StoredTensor> tensors);

  std::string path_;
  ModelConfig config_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::optional<GgufFile> gguf_;
  absl::flat_hash_map<std::string, StoredTensor> tensors_;
};

}  // namespace infinigen
