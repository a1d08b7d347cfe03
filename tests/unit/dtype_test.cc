#include "common/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace infinigen {
namespace {

TEST(DType, HalfRoundTripsEveryBitPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    ASSERT_EQ(FloatToHalf(f), h) << "half bits " << h;
  }
}

TEST(DType, HalfRoundsToNearestEvenAndSaturatesToInfinity) {
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 2048)), 1.0f);                // tie -> even
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);  // tie -> even
  EXPECT_EQ(HalfToFloat(FloatToHalf(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(HalfToFloat(FloatToHalf(65520.0f))));
  EXPECT_EQ(HalfToFloat(FloatToHalf(5.96046448e-8f)), 5.96046448e-8f);  // smallest subnormal
  EXPECT_EQ(HalfToFloat(FloatToHalf(2.0e-8f)), 0.0f);
}

TEST(DType, Bf16IsTheTopHalfOfFloatWithRounding) {
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f)), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-3.5f)), -3.5f);
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: rounds to even (1).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DType, ParseNamesAndRejectsUnknown) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("float32"), DType::kF32);
  auto bad = ParseDType("f64");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("f64"), std::string::npos);
}

}  // namespace
}  // namespace infinigen
