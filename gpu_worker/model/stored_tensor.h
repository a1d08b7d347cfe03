// A tensor as a checkpoint file stores it: its encoding on disk, its shape and where its bytes
// are in a memory-mapped file. Nothing is copied until a backend asks for the values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

// On-disk encodings. The GGUF block formats are llama.cpp's (ggml's) with their type ids.
enum class StorageType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kQ4_0,  // blocks of 32: f16 scale, 16 bytes of 4-bit values, x = (q - 8) * d
  kQ4_1,  // blocks of 32: f16 scale, f16 min, 16 bytes of 4-bit values, x = q * d + m
  kQ5_0,  // blocks of 32: f16 scale, 32 high bits, 16 bytes of low nibbles, x = (q - 16) * d
  kQ5_1,  // blocks of 32: f16 scale, f16 min, 32 high bits, 16 bytes, x = q * d + m
  kQ8_0,  // blocks of 32: f16 scale, 32 int8 values, x = q * d
};

absl::string_view StorageTypeName(StorageType t);
// Elements per block (1 for the plain types) and bytes per block.
int64_t StorageBlockElements(StorageType t);
int64_t StorageBlockBytes(StorageType t);
// Bytes of `num_elements` elements; an error when they do not fill whole blocks.
absl::StatusOr<int64_t> StorageBytes(StorageType t, int64_t num_elements);

struct StoredTensor {
  std::string name;       // canonical (Hugging Face) name, e.g. model.layers.0.mlp.up_proj.weight
  std::string file_name;  // the name inside the file (differs for GGUF: blk.0.ffn_up.weight)
  std::string file;       // path of the file holding it
  StorageType type = StorageType::kF32;
  std::vector<int64_t> shape;  // outermost first, as PyTorch orders it
  const uint8_t* data = nullptr;
  int64_t num_bytes = 0;

  int64_t NumElements() const;
  std::string ShapeString() const;  // "[128, 64]"
};

// Decodes `t` into `dst` (t.NumElements() floats).
void DecodeToFloat(const StoredTensor& t, float* dst);

}  // namespace infinigen
