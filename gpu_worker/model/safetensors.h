// The safetensors format: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and [begin, end) byte range, then the data. Every range is checked
// against the file before anything reads it.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/mapped_file.h"
#include "gpu_worker/model/stored_tensor.h"

namespace infinigen {

// Appends the tensors of `file` to `out`. Errors name the file and the tensor. `metadata`
// (may be null) receives the string entries of the header's "__metadata__".
absl::Status ParseSafetensors(const MappedFile& file, std::vector<StoredTensor>& out,
                              std::map<std::string, std::string>* metadata = nullptr);

// A float32 tensor to write, row-major.
struct SafetensorsEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// Writes a .safetensors file (atomically: a temporary file renamed into place).
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                              const std::map<std::string, std::string>& metadata);

}  // namespace infinigen
