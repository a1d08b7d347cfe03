// Builds GGUF v3 files in memory for tests: valid ones converted from fixtures, and broken ones.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace infinigen::testing {

class GgufWriter {
 public:
  void AddString(const std::string& key, const std::string& value);
  void AddU32(const std::string& key, uint32_t value);
  void AddF32(const std::string& key, float value);
  void AddStringArray(const std::string& key, const std::vector<std::string>& values);
  void AddI32Array(const std::string& key, const std::vector<int32_t>& values);
  void AddF32Array(const std::string& key, const std::vector<float>& values);
  // shape outermost first (as PyTorch); ggml_type is the GGUF type id; bytes are the data.
  // `offset` forces the recorded data offset (to forge overlapping tensors); -1: next free.
  void AddTensor(const std::string& name, const std::vector<int64_t>& shape, uint32_t ggml_type,
                 std::vector<uint8_t> bytes, int64_t offset = -1);
  void AddF32Tensor(const std::string& name, const std::vector<int64_t>& shape,
                    const std::vector<float>& values);

  // The file bytes. `offset_shift` moves every tensor's recorded offset (to forge bad files).
  std::vector<uint8_t> Build(uint64_t offset_shift = 0) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    uint32_t type;
    std::vector<uint8_t> bytes;
    int64_t offset;
  };
  std::vector<uint8_t> kv_;
  uint64_t kv_count_ = 0;
  std::vector<Tensor> tensors_;
};

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes);

}  // namespace infinigen::testing
