#include "tests/support/gguf_writer.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace infinigen::testing {
namespace {

template <typename T>
void Put(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

void PutString(std::vector<uint8_t>& out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

}  // namespace

void GgufWriter::AddString(const std::string& key, const std::string& value) {
  PutString(kv_, key);
  Put<uint32_t>(kv_, 8);
  PutString(kv_, value);
  ++kv_count_;
}

void GgufWriter::AddU32(const std::string& key, uint32_t value) {
  PutString(kv_, key);
  Put<uint32_t>(kv_, 4);
  Put<uint32_t>(kv_, value);
  ++kv_count_;
}

void GgufWriter::AddF32(const std::string& key, float value) {
  PutString(kv_, key);
  Put<uint32_t>(kv_, 6);
  Put<float>(kv_, value);
  ++kv_count_;
}

void GgufWriter::AddStringArray(const std::string& key, const std::vector<std::string>& values) {
  PutString(kv_, key);
  Put<uint32_t>(kv_, 9);
  Put<uint32_t>(kv_, 8);
  Put<uint64_t>(kv_, values.size());
  for (const auto& v : values) PutString(kv_, v);
  ++kv_count_;
}

void GgufWriter::AddI32Array(const std::string& key, const std::vector<int32_t>& values) {
  PutString(kv_, key);
  Put<uint32_t>(kv_, 9);
  Put<uint32_t>(kv_, 5);
  Put<uint64_t>(kv_, values.size());
  for (int32_t v : values) Put<int32_t>(kv_, v);
  ++kv_count_;
}

void GgufWriter::AddF32Array(const std::string& key, const std::vector<float>& values) {
  PutString(kv_, key);
  Put<uint32_t>(kv_, 9);
  Put<uint32_t>(kv_, 6);
  Put<uint64_t>(kv_, values.size());
  for (float v : values) Put<float>(kv_, v);
  ++kv_count_;
}

void GgufWriter::AddTensor(const std::string& name, const std::vector<int64_t>& shape,
                           uint32_t ggml_type, std::vector<uint8_t> bytes, int64_t offset) {
  tensors_.push_back({name, shape, ggml_type, std::move(bytes), offset});
}

void GgufWriter::AddF32Tensor(const std::string& name, const std::vector<int64_t>& shape,
                              const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  AddTensor(name, shape, 0, std::move(bytes));
}

std::vector<uint8_t> GgufWriter::Build(uint64_t offset_shift) const {
  constexpr uint64_t kAlign = 32;
  std::vector<uint8_t> out;
  Put<uint32_t>(out, 0x46554747);
  Put<uint32_t>(out, 3);
  Put<uint64_t>(out, tensors_.size());
  Put<uint64_t>(out, kv_count_);
  out.insert(out.end(), kv_.begin(), kv_.end());
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  for (const Tensor& t : tensors_) {
    PutString(out, t.name);
    Put<uint32_t>(out, static_cast<uint32_t>(t.shape.size()));
    for (auto it = t.shape.rbegin(); it != t.shape.rend(); ++it) Put<uint64_t>(out, *it);
    Put<uint32_t>(out, t.type);
    const uint64_t at = t.offset >= 0 ? static_cast<uint64_t>(t.offset) : offset;
    Put<uint64_t>(out, at + offset_shift);
    offsets.push_back(at);
    offset = std::max(offset, at + (t.bytes.size() + kAlign - 1) / kAlign * kAlign);
  }
  out.resize((out.size() + kAlign - 1) / kAlign * kAlign, 0);
  const size_t data_start = out.size();
  out.resize(data_start + offset, 0);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    std::memcpy(out.data() + data_start + offsets[i], tensors_[i].bytes.data(),
                tensors_[i].bytes.size());
  }
  return out;
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace infinigen::testing
