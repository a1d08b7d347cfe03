// GGUF (llama.cpp's single-file format, versions 2 and 3): metadata key/values, tensor infos and
// an aligned data section. Parsing is bounds-checked; tensors keep their GGUF names here and
// are renamed to Hugging Face names by the checkpoint loader.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mapped_file.h"
#include "gpu_worker/model/config.h"
#include "gpu_worker/model/stored_tensor.h"

namespace infinigen {

enum class GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

struct GgufValue {
  GgufType type = GgufType::kU8;
  uint64_t u = 0;  // unsigned integers and bool
  int64_t i = 0;   // signed integers
  double f = 0.0;  // floats
  std::string s;   // strings
  // An array's elements, by array_type: strings; integers and bools as int64 (u64 bit for
  // bit); floats as double; arrays as values. Kept by type, not as one GgufValue each (~100
  // bytes): a GGUF's vocabulary and merges are ~100k strings held for the model's life.
  GgufType array_type = GgufType::kU8;
  std::vector<std::string> strings;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<GgufValue> arrays;

  size_t ArraySize() const { return strings.size() + ints.size() + floats.size() + arrays.size(); }
  bool IsInteger() const;
  // The value as a signed integer, from any integer type.
  int64_t AsInt() const;
};

struct GgufFile {
  uint32_t version = 0;
  std::map<std::string, GgufValue> metadata;
  std::vector<StoredTensor> tensors;  // GGUF names, shapes outermost first

  static absl::StatusOr<GgufFile> Parse(const MappedFile& file);

  const GgufValue* Find(const std::string& key) const;
  // Typed lookups with a default, and required variants with errors naming the key.
  int64_t IntOr(const std::string& key, int64_t fallback) const;
  double FloatOr(const std::string& key, double fallback) const;
  std::string StringOr(const std::string& key, const std::string& fallback) const;
};

// Builds the model config from a GGUF's metadata (llama architecture). `tensors` are the
// file's tensors (the output and rope_freqs tensors decide tying and scaling).
absl::StatusOr<ModelConfig> GgufModelConfig(const GgufFile& gguf, const std::string& path);

// The Hugging Face name of a GGUF llama tensor ("blk.3.attn_q.weight" ->
// "model.layers.3.self_attn.q_proj.weight"); empty when it has none.
std::string GgufToHfName(const std::string& gguf_name);
// The inverse, for error messages; empty when there is none.
std::string HfToGgufName(const std::string& hf_name);

}  // namespace infinigen
