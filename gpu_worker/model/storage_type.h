// How a checkpoint encodes a tensor's elements: the plain floating types and GGUF's (ggml's)
// block formats with their type ids, their sizes, and their decoding. The 4-bit formats with one
// scale per 32 weights (Q4_0, Q4_1, Q4_K) also convert exactly to Q4_1 blocks
// (kernels/cpu/q4_1.h), the 5-bit ones to Q5_1 blocks and Q6_K and Q3_K to the CPU's Q6_K
// layout: the formats the CPU kernels multiply directly.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace infinigen {

enum class StorageType : uint8_t {
  kF32,
  kF16,
  kBF16,
  // Blocks of 32 weights (byte j of the 16 nibble bytes: element j low, element j + 16 high).
  kQ4_0,  // f16 scale d, 16 bytes of 4-bit q; x = (q - 8) * d
  kQ4_1,  // f16 scale d, f16 min m, 16 bytes of 4-bit q; x = q * d + m
  kQ5_0,  // f16 d, 32 fifth bits, 16 bytes of low nibbles; x = (q - 16) * d
  kQ5_1,  // f16 d, f16 m, 32 fifth bits, 16 bytes of low nibbles; x = q * d + m
  kQ8_0,  // f16 d, 32 int8 q; x = q * d
  // K-quants: super-blocks of 256 weights with sub-block scales quantized against f16 ones.
  kQ2_K,  // 16 sub-blocks of 16: 4-bit scale and min each; 2-bit q; x = d*s*q - dmin*m
  kQ3_K,  // 16 sub-blocks of 16: 6-bit signed scale; 3-bit signed q; x = d*s*q
  kQ4_K,  // 8 sub-blocks of 32: 6-bit scale and min; 4-bit q; x = d*s*q - dmin*m
  kQ5_K,  // as Q4_K with a fifth bit per weight
  kQ6_K,  // 16 sub-blocks of 16: int8 scale; 6-bit q - 32; x = d*s*q
};

absl::string_view StorageTypeName(StorageType t);
// The type of GGML type id `id` (GGUF's tensor info), if it is one this project reads.
absl::StatusOr<StorageType> StorageTypeOfGgml(uint32_t id);
// Elements per block (1 for the plain types) and bytes per block.
int64_t StorageBlockElements(StorageType t);
int64_t StorageBlockBytes(StorageType t);
// Bytes of `num_elements` elements; an error when they do not fill whole blocks.
absl::StatusOr<int64_t> StorageBytes(StorageType t, int64_t num_elements);

// Decodes `blocks` whole blocks (elements, for the plain types) at p into out, the values the
// ggml reference dequantizers give, bit for bit.
void DecodeBlocks(StorageType t, const uint8_t* p, int64_t blocks, float* out);

// Whether blocks of t convert exactly to Q4_1 blocks: Q4_0, Q4_1 and Q4_K.
bool ConvertsToQ4_1(StorageType t);
// `blocks` blocks of such a type at p as Q4_1 blocks of 32 weights (StorageBlockElements(t) / 32
// of them per block): block i's nibbles at qs + 16 i, its scale d[i] and minimum m[i], so that
// fma(q, d, m) is exactly the value DecodeBlocks gives.
void ConvertToQ4_1(StorageType t, const uint8_t* p, int64_t blocks, uint8_t* qs, float* d,
                   float* m);
// Whether blocks of t convert to Q4_1 blocks whose minimum is always -8 times their scale (the
// file's Q4_0: (q - 8) d): ConvertToQ4_1 then takes m = nullptr and writes no minimums, and a
// CPU matrix keeps none (kernels/cpu/q4_1.h).
bool ConvertsToQ4_0(StorageType t);

// Whether blocks of t convert exactly to Q5_1 blocks: the Q4_1 ones and Q5_0, Q5_1 and Q5_K.
bool ConvertsToQ5_1(StorageType t);
// `blocks` blocks of such a type at p as Q5_1 blocks of 32 weights (StorageBlockElements(t) / 32
// of them per block): block i's low nibbles at qs + 16 i, its fifth bits qh[i], its scale d[i]
// and minimum m[i], so that fma(q, d, m) is exactly the value DecodeBlocks gives.
void ConvertToQ5_1(StorageType t, const uint8_t* p, int64_t blocks, uint8_t* qs, uint32_t* qh,
                   float* d, float* m);
// Whether blocks of t convert to Q5_1 blocks whose minimum is always -16 times their scale (the
// file's Q5_0: (q - 16) d): ConvertToQ5_1 then takes m = nullptr and writes no minimums, and a
// CPU matrix keeps none (kernels/cpu/q5_1.h).
bool ConvertsToQ5_0(StorageType t);

// Whether blocks of t convert exactly to the CPU's Q6_K layout (kernels/cpu/q6_k.h): Q6_K, and
// Q3_K (its signed 3-bit values plus 32, its 6-bit scales as they are).
bool ConvertsToQ6_K(StorageType t);
// `blocks` such super-blocks at p in that layout (8 blocks of 32, 4 pairs, one d each): their
// nibbles at ql, high bits at qh, scales at s, d at d, so that (d s) (q - 32) is exactly the
// value DecodeBlocks gives.
void ConvertToQ6_K(StorageType t, const uint8_t* p, int64_t blocks, uint8_t* ql, uint8_t* qh,
                   int8_t* s, float* d);

}  // namespace infinigen
