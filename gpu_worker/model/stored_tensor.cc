#include "gpu_worker/model/stored_tensor.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"

namespace infinigen {
namespace {

constexpr int64_t kQuantBlock = 32;

uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The nibble layout shared by Q4_x and Q5_x: byte j holds element j (low) and j + 16 (high).
void DecodeQ4Block(const uint8_t* qs, float d, float m, int offset, float* out) {
  for (int j = 0; j < 16; ++j) {
    out[j] = static_cast<float>((qs[j] & 0x0f) - offset) * d + m;
    out[j + 16] = static_cast<float>((qs[j] >> 4) - offset) * d + m;
  }
}

void DecodeQ5Block(const uint8_t* qh_bytes, const uint8_t* qs, float d, float m, int offset,
                   float* out) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    const int hi0 = ((qh >> j) << 4) & 0x10;
    const int hi1 = (qh >> (j + 12)) & 0x10;
    out[j] = static_cast<float>(((qs[j] & 0x0f) | hi0) - offset) * d + m;
    out[j + 16] = static_cast<float>(((qs[j] >> 4) | hi1) - offset) * d + m;
  }
}

}  // namespace

absl::string_view StorageTypeName(StorageType t) {
  switch (t) {
    case StorageType::kF32:
      return "F32";
    case StorageType::kF16:
      return "F16";
    case StorageType::kBF16:
      return "BF16";
    case StorageType::kQ4_0:
      return "Q4_0";
    case StorageType::kQ4_1:
      return "Q4_1";
    case StorageType::kQ5_0:
      return "Q5_0";
    case StorageType::kQ5_1:
      return "Q5_1";
    case StorageType::kQ8_0:
      return "Q8_0";
  }
  return "?";
}

int64_t StorageBlockElements(StorageType t) {
  switch (t) {
    case StorageType::kF32:
    case StorageType::kF16:
    case StorageType::kBF16:
      return 1;
    default:
      return kQuantBlock;
  }
}

int64_t StorageBlockBytes(StorageType t) {
  switch (t) {
    case StorageType::kF32:
      return 4;
    case StorageType::kF16:
      return 2;
    case StorageType::kBF16:
      return 2;
    case StorageType::kQ4_0:
      return 2 + 16;
    case StorageType::kQ4_1:
      return 2 + 2 + 16;
    case StorageType::kQ5_0:
      return 2 + 4 + 16;
    case StorageType::kQ5_1:
      return 2 + 2 + 4 + 16;
    case StorageType::kQ8_0:
      return 2 + 32;
  }
  return 0;
}

absl::StatusOr<int64_t> StorageBytes(StorageType t, int64_t num_elements) {
  const int64_t block = StorageBlockElements(t);
  if (num_elements % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        num_elements, " elements of type ", StorageTypeName(t), " do not fill blocks of ", block));
  }
  return num_elements / block * StorageBlockBytes(t);
}

int64_t StoredTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string StoredTensor::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

void DecodeToFloat(const StoredTensor& t, float* dst) {
  const int64_t n = t.NumElements();
  const uint8_t* p = t.data;
  switch (t.type) {
    case StorageType::kF32:
      std::memcpy(dst, p, n * 4);
      return;
    case StorageType::kF16:
      ConvertToFloat(DType::kF16, p, dst, n);
      return;
    case StorageType::kBF16:
      ConvertToFloat(DType::kBF16, p, dst, n);
      return;
    default:
      break;
  }
  const int64_t blocks = n / kQuantBlock;
  const int64_t block_bytes = StorageBlockBytes(t.type);
#pragma omp parallel for if (blocks > 4096)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = p + b * block_bytes;
    float* out = dst + b * kQuantBlock;
    const float d = HalfToFloat(LoadU16(blk));
    switch (t.type) {
      case StorageType::kQ4_0:
        DecodeQ4Block(blk + 2, d, 0.0f, 8, out);
        break;
      case StorageType::kQ4_1:
        DecodeQ4Block(blk + 4, d, HalfToFloat(LoadU16(blk + 2)), 0, out);
        break;
      case StorageType::kQ5_0:
        DecodeQ5Block(blk + 2, blk + 6, d, 0.0f, 16, out);
        break;
      case StorageType::kQ5_1:
        DecodeQ5Block(blk + 4, blk + 8, d, HalfToFloat(LoadU16(blk + 2)), 0, out);
        break;
      case StorageType::kQ8_0:
        for (int j = 0; j < kQuantBlock; ++j) {
          out[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
        }
        break;
      default:
        break;
    }
  }
}

}  // namespace infinigen
