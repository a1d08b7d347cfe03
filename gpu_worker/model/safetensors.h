// The safetensors format: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and [begin, end) byte range, then the data. Every range is checked
// against the file before anything reads it.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/mapped_file.h"
#include "gpu_worker/model/stored_tensor.h"

namespace infinigen {

// Appends the tensors of `file` to `out`. Errors name the file and the tensor. `metadata`
// (may be null) receives the string entries of the header's "__metadata__".
absl::Status ParseSafetensors(const MappedFile& file, std::vector<StoredTensor>& out,
                              std::map<std::string, std::string>* metadata = nullptr);

// The shard files a sharded checkpoint's model.safetensors.index.json (`text`, read from
// `where`) names in its "weight_map": sorted, each once, each a plain file name in the index's
// folder (not empty, no '/', not "." or "..", no NUL byte). INVALID_ARGUMENT naming `where` and
// the entry for anything else, or for an index that names no shard.
absl::StatusOr<std::vector<std::string>> ParseSafetensorsIndex(absl::string_view text,
                                                               absl::string_view where);

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
