// A tensor as a checkpoint file stores it: its encoding on disk, its shape and where its bytes
// are in a memory-mapped file. Nothing is copied until a backend asks for the values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_worker/model/storage_type.h"

namespace infinigen {

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
