// Minimal NumPy .npy (format 1.0/2.0) reader and writer for little-endian, C-order arrays.
// It is how logits leave the engine (`infinigen logits`) and how test fixtures come in.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace infinigen {

struct NpyArray {
  std::string descr;           // numpy dtype string, e.g. "<f4", "<i4", "<i8"
  std::vector<int64_t> shape;  // C order
  std::vector<uint8_t> data;   // raw little-endian bytes

  int64_t NumElements() const;
  // Element access with conversion; fails on an unsupported descr.
  absl::StatusOr<std::vector<float>> AsFloat() const;
  absl::StatusOr<std::vector<int64_t>> AsInt() const;
};

absl::StatusOr<NpyArray> ReadNpy(const std::string& path);
absl::Status WriteNpyF32(const std::string& path, const std::vector<int64_t>& shape,
                         const float* data);

}  // namespace infinigen
