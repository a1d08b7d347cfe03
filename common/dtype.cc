#include "common/dtype.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace infinigen {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "f32" || name == "float32") return DType::kF32;
  if (name == "f16" || name == "float16") return DType::kF16;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "': expected f32, f16 or bf16"));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24.
    float f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {
    // Result is subnormal in half (or zero): value / 2^-24, rounded to nearest even.
    const float scaled = BitsToFloat(abs) * 16777216.0f;  // exact: power of two
    const float r = std::nearbyint(scaled);               // default rounding: nearest even
    return sign | static_cast<uint16_t>(r);
  }
  // Normal: keep 10 mantissa bits with round to nearest even on the 13 dropped bits.
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

void ConvertToFloat(DType src_type, const void* src, float* dst, size_t count) {
  switch (src_type) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    // Loads through memcpy: checkpoint bytes need not be 2-byte aligned (a safetensors header
    // of odd length puts every tensor at an odd address; found by fuzzing).
    case DType::kF16: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, s + 2 * i, 2);
        dst[i] = HalfToFloat(h);
      }
      return;
    }
    case DType::kBF16: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, s + 2 * i, 2);
        dst[i] = Bf16ToFloat(h);
      }
      return;
    }
  }
}

void ConvertFromFloat(const float* src, DType dst_type, void* dst, size_t count) {
  switch (dst_type) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = FloatToHalf(src[i]);
      return;
    }
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
  }
}

}  // namespace infinigen
