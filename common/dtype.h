// Element types of tensors that live in a backend's memory (activations, weights, K/V), and
// exact scalar conversions between them and float.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
absl::string_view DTypeName(DType t);
// Parses "f32"/"float32", "f16"/"float16", "bf16"/"bfloat16".
absl::StatusOr<DType> ParseDType(absl::string_view name);

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float HalfToFloat(uint16_t h);
// Round to nearest even, overflow to infinity, NaN stays NaN.
uint16_t FloatToHalf(float f);

// Converts `count` elements of type `src_type` at `src` to float.
void ConvertToFloat(DType src_type, const void* src, float* dst, size_t count);
// Converts `count` floats to `dst_type` at `dst`.
void ConvertFromFloat(const float* src, DType dst_type, void* dst, size_t count);

}  // namespace infinigen
