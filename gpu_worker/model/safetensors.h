// The safetensors format: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and [begin, end) byte range, then the data. Every range is checked
// against the file before anything reads it.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "common/mapped_file.h"
#include "gpu_worker/model/stored_tensor.h"

namespace infinigen {

// Appends the tensors of `file` to `out`. Errors name the file and the tensor.
absl::Status ParseSafetensors(const MappedFile& file, std::vector<StoredTensor>& out);

}  // namespace infinigen
