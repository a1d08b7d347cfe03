#include "gpu_worker/model/storage_type.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/q4_1.h"
#include "kernels/cpu/q5_1.h"

namespace infinigen {
namespace {

constexpr int64_t kBlock = 32;   // the legacy formats' block
constexpr int64_t kSuper = 256;  // the K-quants' super-block

float Half(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return HalfToFloat(v);
}

// Q4_x and Q5_x nibbles: byte j holds element j (low) and j + 16 (high). The _0 formats are
// (q - offset) * d, the _1 ones q * d + m: adding a zero minimum would turn the reference's -0
// into +0.
float Value(int q, float d, float m, int offset) {
  return offset != 0 ? static_cast<float>(q - offset) * d : static_cast<float>(q) * d + m;
}

void DecodeQ4(const uint8_t* qs, float d, float m, int offset, float* out) {
  for (int j = 0; j < 16; ++j) {
    out[j] = Value(qs[j] & 0x0f, d, m, offset);
    out[j + 16] = Value(qs[j] >> 4, d, m, offset);
  }
}

void DecodeQ5(const uint8_t* qh_bytes, const uint8_t* qs, float d, float m, int offset,
              float* out) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    const int hi0 = ((qh >> j) << 4) & 0x10;
    const int hi1 = (qh >> (j + 12)) & 0x10;
    out[j] = Value((qs[j] & 0x0f) | hi0, d, m, offset);
    out[j + 16] = Value((qs[j] >> 4) | hi1, d, m, offset);
  }
}

// Q4_K / Q5_K: eight 6-bit scales and minimums packed in 12 bytes.
void ScaleMinK4(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Sub-block j (of 8) of a Q4_K / Q5_K super-block: its 32 weights' low nibbles are bits 4(j%2)..
// of bytes 32(j/2)..32(j/2)+31.
int LowNibbleK(const uint8_t* qs, int j, int l) {
  return (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f;
}

// d*s is exact in float32 (11 + 6 bits), and so is its product with a 4- or 5-bit q, so the
// subtraction is the only rounding, as in the reference.
void DecodeQ4K(const uint8_t* b, float* out, bool five_bits) {
  const float d = Half(b), dmin = Half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = five_bits ? b + 48 : b + 16;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    ScaleMinK4(scales, j, sc, mn);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
    for (int l = 0; l < 32; ++l) {
      int q = LowNibbleK(qs, j, l);
      if (five_bits) q |= ((qh[l] >> j) & 1) << 4;
      out[32 * j + l] = dl * static_cast<float>(q) - ml;
    }
  }
}

void DecodeQ2K(const uint8_t* b, float* out) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = Half(b + 80), dmin = Half(b + 82);
  for (int i = 0; i < kSuper; ++i) {
    const int h = i / 128, s = (i % 128) / 32, l = i % 32;
    const int q = (qs[32 * h + l] >> (2 * s)) & 3;
    const int sc = scales[i / 16];
    const float dl = d * static_cast<float>(sc & 0x0f), ml = dmin * static_cast<float>(sc >> 4);
    out[i] = dl * static_cast<float>(q) - ml;
  }
}

// Sub-block k's (of 16) signed scale (-32..31) in the Q3_K super-block at b.
int Q3KScale(const uint8_t* b, int k) {
  const uint8_t* s = b + 96;
  const int low = k < 8 ? (s[k] & 0x0f) : (s[k - 8] >> 4);
  const int high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// Element i's signed value (-4..3) in the Q3_K super-block at b.
int Q3KValue(const uint8_t* b, int i) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const int h = i / 128, shift = (i % 128) / 32, l = i % 32;
  return ((qs[32 * h + l] >> (2 * shift)) & 3) - (((hmask[l] >> (i / 32)) & 1) ? 0 : 4);
}

void DecodeQ3K(const uint8_t* b, float* out) {
  const float d = Half(b + 108);
  for (int i = 0; i < kSuper; ++i) {
    out[i] = d * static_cast<float>(Q3KScale(b, i / 16)) * static_cast<float>(Q3KValue(b, i));
  }
}

// Element i's 6-bit value (0-63) in the Q6_K super-block at b.
int Q6KValue(const uint8_t* b, int i) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int h = i / 128, r = i % 128;
  const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f;
  const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
  return low | (high << 4);
}

void DecodeQ6K(const uint8_t* b, float* out) {
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = Half(b + 208);
  for (int i = 0; i < kSuper; ++i) {
    // (d * s) first, then q: the reference's order (their product can round).
    const float ds = d * static_cast<float>(scales[i / 16]);
    out[i] = ds * static_cast<float>(Q6KValue(b, i) - 32);
  }
}

void DecodeBlock(StorageType t, const uint8_t* b, float* out) {
  switch (t) {
    case StorageType::kQ4_0:
      return DecodeQ4(b + 2, Half(b), 0.0f, 8, out);
    case StorageType::kQ4_1:
      return DecodeQ4(b + 4, Half(b), Half(b + 2), 0, out);
    case StorageType::kQ5_0:
      return DecodeQ5(b + 2, b + 6, Half(b), 0.0f, 16, out);
    case StorageType::kQ5_1:
      return DecodeQ5(b + 4, b + 8, Half(b), Half(b + 2), 0, out);
    case StorageType::kQ8_0: {
      const float d = Half(b);
      for (int j = 0; j < kBlock; ++j)
        out[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
      return;
    }
    case StorageType::kQ2_K:
      return DecodeQ2K(b, out);
    case StorageType::kQ3_K:
      return DecodeQ3K(b, out);
    case StorageType::kQ4_K:
      return DecodeQ4K(b, out, false);
    case StorageType::kQ5_K:
      return DecodeQ4K(b, out, true);
    case StorageType::kQ6_K:
      return DecodeQ6K(b, out);
    default:
      return;
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
    case StorageType::kQ2_K:
      return "Q2_K";
    case StorageType::kQ3_K:
      return "Q3_K";
    case StorageType::kQ4_K:
      return "Q4_K";
    case StorageType::kQ5_K:
      return "Q5_K";
    case StorageType::kQ6_K:
      return "Q6_K";
  }
  return "?";
}

absl::StatusOr<StorageType> StorageTypeOfGgml(uint32_t id) {
  switch (id) {
    case 0:
      return StorageType::kF32;
    case 1:
      return StorageType::kF16;
    case 2:
      return StorageType::kQ4_0;
    case 3:
      return StorageType::kQ4_1;
    case 6:
      return StorageType::kQ5_0;
    case 7:
      return StorageType::kQ5_1;
    case 8:
      return StorageType::kQ8_0;
    case 10:
      return StorageType::kQ2_K;
    case 11:
      return StorageType::kQ3_K;
    case 12:
      return StorageType::kQ4_K;
    case 13:
      return StorageType::kQ5_K;
    case 14:
      return StorageType::kQ6_K;
    case 30:
      return StorageType::kBF16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "GGML type id ", id,
          " is not supported (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, "
          "Q5_K, Q6_K)"));
  }
}

int64_t StorageBlockElements(StorageType t) {
  switch (t) {
    case StorageType::kF32:
    case StorageType::kF16:
    case StorageType::kBF16:
      return 1;
    case StorageType::kQ2_K:
    case StorageType::kQ3_K:
    case StorageType::kQ4_K:
    case StorageType::kQ5_K:
    case StorageType::kQ6_K:
      return kSuper;
    default:
      return kBlock;
  }
}

int64_t StorageBlockBytes(StorageType t) {
  switch (t) {
    case StorageType::kF32:
      return 4;
    case StorageType::kF16:
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
    case StorageType::kQ2_K:
      return 16 + 64 + 2 + 2;
    case StorageType::kQ3_K:
      return 32 + 64 + 12 + 2;
    case StorageType::kQ4_K:
      return 2 + 2 + 12 + 128;
    case StorageType::kQ5_K:
      return 2 + 2 + 12 + 32 + 128;
    case StorageType::kQ6_K:
      return 128 + 64 + 16 + 2;
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

void DecodeBlocks(StorageType t, const uint8_t* p, int64_t blocks, float* out) {
  switch (t) {
    case StorageType::kF32:
      std::memcpy(out, p, blocks * 4);
      return;
    case StorageType::kF16:
      ConvertToFloat(DType::kF16, p, out, blocks);
      return;
    case StorageType::kBF16:
      ConvertToFloat(DType::kBF16, p, out, blocks);
      return;
    default:
      break;
  }
  const int64_t elements = StorageBlockElements(t), bytes = StorageBlockBytes(t);
  cpu::ParallelFor(blocks, blocks * elements > (1 << 17),
                   [&](int64_t b) { DecodeBlock(t, p + b * bytes, out + b * elements); });
}

namespace {

// Sub-block j of the Q4_K / Q5_K super-block at blk (its low nibbles at `nibbles`) as Q4_1 block
// `at`: d * s and dmin * m are exact in float32 (11 + 6 bits), so fma(q, d * s, -dmin * m) is
// the reference's d * s * q - dmin * m.
void KSubBlockToQ4_1(const uint8_t* blk, const uint8_t* nibbles, int j, int64_t at, uint8_t* qs,
                     float* d, float* m) {
  int sc, mn;
  ScaleMinK4(blk + 4, j, sc, mn);
  d[at] = Half(blk) * static_cast<float>(sc);
  m[at] = -(Half(blk + 2) * static_cast<float>(mn));
  uint8_t* out = qs + 16 * at;
  for (int l = 0; l < 16; ++l) {
    out[l] =
        static_cast<uint8_t>(LowNibbleK(nibbles, j, l) | (LowNibbleK(nibbles, j, l + 16) << 4));
  }
}

}  // namespace

bool ConvertsToQ4_1(StorageType t) {
  return t == StorageType::kQ4_0 || t == StorageType::kQ4_1 || t == StorageType::kQ4_K;
}

void ConvertToQ4_1(StorageType t, const uint8_t* p, int64_t blocks, uint8_t* qs, float* d,
                   float* m) {
  const int64_t bytes = StorageBlockBytes(t);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = p + b * bytes;
    switch (t) {
      case StorageType::kQ4_0:
        // fma(q, d, -8d) is (q - 8) * d exactly: both products are exact in float32.
        d[b] = Half(blk);
        if (m != nullptr) m[b] = cpu::kQ4Centered * d[b];
        std::memcpy(qs + 16 * b, blk + 2, 16);
        break;
      case StorageType::kQ4_1:
        d[b] = Half(blk);
        m[b] = Half(blk + 2);
        std::memcpy(qs + 16 * b, blk + 4, 16);
        break;
      case StorageType::kQ4_K:
        for (int j = 0; j < 8; ++j) KSubBlockToQ4_1(blk, blk + 16, j, 8 * b + j, qs, d, m);
        break;
      default:
        break;
    }
  }
}

bool ConvertsToQ5_1(StorageType t) {
  return ConvertsToQ4_1(t) || t == StorageType::kQ5_0 || t == StorageType::kQ5_1 ||
         t == StorageType::kQ5_K;
}

// q * d is exact in float32 for every 5-bit q (d: an 11-bit float16 significand, or Q5_K's d * s
// of 17 bits), so fma(q, d, m) rounds once where the reference's q * d + m and (q - 16) * d do.
void ConvertToQ5_1(StorageType t, const uint8_t* p, int64_t blocks, uint8_t* qs, uint32_t* qh,
                   float* d, float* m) {
  if (ConvertsToQ4_1(t)) {
    ConvertToQ4_1(t, p, blocks, qs, d, m);
    std::memset(qh, 0, static_cast<size_t>(blocks * StorageBlockElements(t) / kBlock) * 4);
    return;
  }
  const int64_t bytes = StorageBlockBytes(t);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = p + b * bytes;
    switch (t) {
      case StorageType::kQ5_0:
        // fma(q, d, -16d) is (q - 16) * d rounded once, as the reference rounds it.
        d[b] = Half(blk);
        if (m != nullptr) m[b] = cpu::kQ5Centered * d[b];
        std::memcpy(&qh[b], blk + 2, 4);
        std::memcpy(qs + 16 * b, blk + 6, 16);
        break;
      case StorageType::kQ5_1:
        d[b] = Half(blk);
        m[b] = Half(blk + 2);
        std::memcpy(&qh[b], blk + 4, 4);
        std::memcpy(qs + 16 * b, blk + 8, 16);
        break;
      case StorageType::kQ5_K: {
        const uint8_t* high = blk + 16;  // bit j of byte l: sub-block j's element l
        for (int j = 0; j < 8; ++j) {
          const int64_t at = 8 * b + j;
          KSubBlockToQ4_1(blk, blk + 48, j, at, qs, d, m);
          uint32_t bits = 0;
          for (int l = 0; l < 32; ++l) bits |= static_cast<uint32_t>((high[l] >> j) & 1) << l;
          qh[at] = bits;
        }
        break;
      }
      default:
        break;
    }
  }
}

bool ConvertsToQ4_0(StorageType t) { return t == StorageType::kQ4_0; }

bool ConvertsToQ5_0(StorageType t) { return t == StorageType::kQ5_0; }

bool ConvertsToQ6_K(StorageType t) { return t == StorageType::kQ6_K || t == StorageType::kQ3_K; }

// Q6_K's 6-bit values, and Q3_K's -4..3 as 28..35: (d s) (q - 32) is then the reference's
// value, Q3_K's d s q included ((d s) is exact in float32: 11 + 6 bits).
void ConvertToQ6_K(StorageType t, const uint8_t* p, int64_t blocks, uint8_t* ql, uint8_t* qh,
                   int8_t* s, float* d) {
  if (!ConvertsToQ6_K(t)) return;
  // Pair j (of 4) of a super-block: group g's 16 elements start at 64 j + kGroupStart[g] and
  // have the reference's scale 4 j + kGroupScale[g] (kernels/cpu/q6_k.h's groups).
  constexpr int kGroupStart[4] = {0, 32, 16, 48}, kGroupScale[4] = {0, 2, 1, 3};
  const bool six = t == StorageType::kQ6_K;
  const int64_t bytes = StorageBlockBytes(t);
  int q[kSuper], scales[16];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = p + b * bytes;
    d[b] = Half(blk + (six ? 208 : 108));
    for (int i = 0; i < kSuper; ++i) q[i] = six ? Q6KValue(blk, i) : Q3KValue(blk, i) + 32;
    for (int k = 0; k < 16; ++k) {
      scales[k] = six ? reinterpret_cast<const int8_t*>(blk + 192)[k] : Q3KScale(blk, k);
    }
    for (int k = 0; k < 8; ++k) {  // block k's nibbles
      uint8_t* out = ql + 16 * (8 * b + k);
      for (int l = 0; l < 16; ++l) {
        out[l] = static_cast<uint8_t>((q[32 * k + l] & 0x0f) | ((q[32 * k + 16 + l] & 0x0f) << 4));
      }
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t pair = 4 * b + j;
      for (int g = 0; g < 4; ++g) {
        s[4 * pair + g] = static_cast<int8_t>(scales[4 * j + kGroupScale[g]]);
      }
      for (int l = 0; l < 16; ++l) {
        int bits = 0;
        for (int g = 0; g < 4; ++g) bits |= (q[64 * j + kGroupStart[g] + l] >> 4) << (2 * g);
        qh[16 * pair + l] = static_cast<uint8_t>(bits);
      }
    }
  }
}

}  // namespace infinigen
