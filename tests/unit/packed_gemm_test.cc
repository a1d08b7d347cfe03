// bf16 and Q8 weight GEMMs against double-precision products of the same (rounded) weights.
#include "kernels/cpu/packed_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/dtype.h"

namespace infinigen::cpu {
namespace {

struct Case {
  int64_t m, n, k;
};

class PackedGemm : public ::testing::TestWithParam<Case> {};

TEST_P(PackedGemm, Bf16MatchesDoubleProductOfRoundedWeights) {
  const auto [m, n, k] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(m * 7 + n));
  std::normal_distribution<float> d;
  const int64_t ldx = k + 5, ldy = n + 3;
  std::vector<float> x(m * ldx), bias(n), y(m * ldy, 0.5f);
  std::vector<uint16_t> w(n * k);
  for (auto& v : x) v = d(rng);
  for (auto& v : bias) v = d(rng);
  for (auto& v : w) v = FloatToBf16(d(rng));
  auto y0 = y;
  GemmBf16(x.data(), ldx, w.data(), bias.data(), y.data(), ldy, m, n, k, /*accumulate=*/true);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = y0[i * ldy + j] + bias[j];
      for (int64_t p = 0; p < k; ++p) s += double(x[i * ldx + p]) * Bf16ToFloat(w[j * k + p]);
      ASSERT_NEAR(y[i * ldy + j], s, 1e-4 * (1 + std::abs(s))) << i << "," << j;
    }
  }
}

TEST_P(PackedGemm, Q8MatchesDoubleProductOfDequantizedWeights) {
  const auto [m, n, k0] = GetParam();
  const int64_t k = (k0 + kQ8Block - 1) / kQ8Block * kQ8Block;
  std::mt19937 rng(static_cast<unsigned>(m * 11 + n));
  std::normal_distribution<float> d;
  std::vector<float> x(m * k), w(n * k), y(m * n);
  for (auto& v : x) v = d(rng);
  for (auto& v : w) v = d(rng);
  std::vector<int8_t> qs(n * k);
  std::vector<float> scales(n * k / kQ8Block);
  QuantizeQ8(w.data(), n, k, qs.data(), scales.data());
  // Quantization error of the weights themselves: at most half a step per weight.
  for (int64_t i = 0; i < n * k; ++i) {
    ASSERT_LE(std::abs(qs[i] * scales[i / kQ8Block] - w[i]), scales[i / kQ8Block] * 0.5f + 1e-7f);
  }
  GemmQ8(x.data(), k, {qs.data(), scales.data(), n, k}, nullptr, y.data(), n, m, false);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, abs_sum = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double wq = double(qs[j * k + p]) * scales[(j * k + p) / kQ8Block];
        s += x[i * k + p] * wq;
        abs_sum += std::abs(x[i * k + p] * wq);
      }
      // Decode batches (up to 16 rows) also quantize x to int8 per block: error up to ~1/254
      // of each term. Larger batches (prefill) multiply float activations.
      const double tol = m <= 16 ? abs_sum / 200 : 1e-4 * (1 + std::abs(s));
      ASSERT_NEAR(y[i * n + j], s, tol) << i << "," << j;
    }
  }
  // A row of a decode batch gets exactly what it gets alone.
  if (m <= 16) {
    std::vector<float> alone(n);
    for (int64_t i = 0; i < m; ++i) {
      GemmQ8(x.data() + i * k, k, {qs.data(), scales.data(), n, k}, nullptr, alone.data(), n, 1,
             false);
      for (int64_t j = 0; j < n; ++j) ASSERT_EQ(alone[j], y[i * n + j]) << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PackedGemm,
                         ::testing::Values(Case{1, 7, 64}, Case{1, 130, 96}, Case{1, 3, 40},
                                           Case{5, 300, 64}, Case{3, 17, 33}, Case{16, 129, 64},
                                           Case{20, 70, 64}));

TEST(PackedGemm, EmbeddingRowsWidenExactly) {
  std::vector<float> table(5 * 64);
  for (size_t i = 0; i < table.size(); ++i) table[i] = std::sin(0.37f * i);
  std::vector<uint16_t> bf(table.size());
  ConvertFromFloat(table.data(), DType::kBF16, bf.data(), table.size());
  std::vector<int8_t> qs(table.size());
  std::vector<float> scales(table.size() / kQ8Block);
  QuantizeQ8(table.data(), 5, 64, qs.data(), scales.data());
  std::vector<int32_t> ids = {4, 0};
  std::vector<float> a(2 * 64), b(2 * 64);
  EmbeddingBf16(bf.data(), 64, ids.data(), 2, a.data(), 64);
  EmbeddingQ8({qs.data(), scales.data(), 5, 64}, ids.data(), 2, b.data(), 64);
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 64; ++c) {
      EXPECT_EQ(a[r * 64 + c], Bf16ToFloat(bf[ids[r] * 64 + c]));
      EXPECT_EQ(b[r * 64 + c], qs[ids[r] * 64 + c] * scales[(ids[r] * 64 + c) / kQ8Block]);
    }
  }
}

}  // namespace
}  // namespace infinigen::cpu
