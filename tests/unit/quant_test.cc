// GGUF block formats decoded against values written out by hand from the format's definition.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "gpu_worker/model/stored_tensor.h"

namespace infinigen {
namespace {

void PutHalf(std::vector<uint8_t>& b, float v) {
  const uint16_t h = FloatToHalf(v);
  b.push_back(h & 0xff);
  b.push_back(h >> 8);
}

std::vector<float> Decode(StorageType type, const std::vector<uint8_t>& bytes, int64_t n) {
  StoredTensor t;
  t.type = type;
  t.shape = {n};
  t.data = bytes.data();
  t.num_bytes = static_cast<int64_t>(bytes.size());
  std::vector<float> out(n);
  DecodeToFloat(t, out.data());
  return out;
}

TEST(Quant, Q8_0) {
  std::vector<uint8_t> b;
  PutHalf(b, 0.5f);
  for (int j = 0; j < 32; ++j) b.push_back(static_cast<uint8_t>(static_cast<int8_t>(j * 8 - 128)));
  auto out = Decode(StorageType::kQ8_0, b, 32);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(out[j], (j * 8 - 128) * 0.5f) << j;
}

TEST(Quant, Q4_0AndQ4_1NibbleOrder) {
  // Element j < 16 is the low nibble of byte j, element j + 16 the high nibble.
  std::vector<uint8_t> q(16);
  for (int j = 0; j < 16; ++j) q[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  std::vector<uint8_t> b0;
  PutHalf(b0, 0.25f);
  b0.insert(b0.end(), q.begin(), q.end());
  auto out0 = Decode(StorageType::kQ4_0, b0, 32);
  std::vector<uint8_t> b1;
  PutHalf(b1, 0.5f);
  PutHalf(b1, -1.0f);
  b1.insert(b1.end(), q.begin(), q.end());
  auto out1 = Decode(StorageType::kQ4_1, b1, 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out0[j], (j - 8) * 0.25f);
    EXPECT_EQ(out0[j + 16], ((15 - j) - 8) * 0.25f);
    EXPECT_EQ(out1[j], j * 0.5f - 1.0f);
    EXPECT_EQ(out1[j + 16], (15 - j) * 0.5f - 1.0f);
  }
}

TEST(Quant, Q5_0AndQ5_1HighBits) {
  // Bit j of the 32-bit high word is the fifth bit of element j.
  const uint32_t qh = 0xA5F0C31Eu;
  std::vector<uint8_t> q(16);
  for (int j = 0; j < 16; ++j) q[j] = static_cast<uint8_t>((j * 5 % 16) | ((j * 3 % 16) << 4));
  auto value = [&](int e) {
    const int low = e < 16 ? (q[e] & 0xf) : (q[e - 16] >> 4);
    return static_cast<int>(low | (((qh >> e) & 1u) << 4));
  };
  std::vector<uint8_t> b0;
  PutHalf(b0, 2.0f);
  for (int i = 0; i < 4; ++i) b0.push_back((qh >> (8 * i)) & 0xff);
  b0.insert(b0.end(), q.begin(), q.end());
  auto out0 = Decode(StorageType::kQ5_0, b0, 32);
  std::vector<uint8_t> b1;
  PutHalf(b1, 0.5f);
  PutHalf(b1, 3.0f);
  for (int i = 0; i < 4; ++i) b1.push_back((qh >> (8 * i)) & 0xff);
  b1.insert(b1.end(), q.begin(), q.end());
  auto out1 = Decode(StorageType::kQ5_1, b1, 32);
  for (int e = 0; e < 32; ++e) {
    EXPECT_EQ(out0[e], (value(e) - 16) * 2.0f) << e;
    EXPECT_EQ(out1[e], value(e) * 0.5f + 3.0f) << e;
  }
}

TEST(Quant, SizesAndPartialBlocks) {
  EXPECT_EQ(*StorageBytes(StorageType::kQ4_1, 64), 40);
  EXPECT_EQ(*StorageBytes(StorageType::kBF16, 3), 6);
  auto bad = StorageBytes(StorageType::kQ8_0, 33);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace infinigen
