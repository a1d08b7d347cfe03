// The batch-invariant GEMMs (kernels/cpu/row_gemm.h): each weight format against a
// double-precision product of the same (rounded) weights on odd sizes (rows and columns not
// multiples of any tile, k with tails); every row equal bit for bit to that row multiplied alone;
// and the AVX-512 kernels equal to the AVX2 kernels bit for bit (each ISA forced in turn; that
// part is skipped with a message where the CPU has no AVX-512).
#include "kernels/cpu/row_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/q4_1.h"
#include "kernels/cpu/q5_1.h"
#include "kernels/cpu/q6_k.h"

namespace infinigen::cpu {
namespace {

struct Case {
  int64_t m, n, k;
};

// One weight matrix [n, k] in every format, with the floats each format's kernel multiplies.
struct Weights {
  Weights(int64_t n, int64_t k, unsigned seed) : n(n), k(k) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d;
    f32.resize(n * k);
    for (auto& v : f32) v = d(rng);
    bf16.resize(n * k);
    for (int64_t i = 0; i < n * k; ++i) bf16[i] = FloatToBf16(f32[i]);
    if (k % kQ8Block == 0) {
      q8_qs.resize(n * k);
      q8_scales.resize(n * k / kQ8Block);
      QuantizeQ8(f32.data(), n, k, q8_qs.data(), q8_scales.data());
      // -128 (QuantizeQ8 never makes it): the integer paths' largest |q|, in case a format
      // ever keeps a file's Q8_0 bytes as they are.
      for (size_t i = 0; i < q8_qs.size(); i += 7) q8_qs[i] = -128;
      q4_qs.resize(n * k / 2);
      q4_d.resize(n * k / kQ4Block);
      q4_m.resize(n * k / kQ4Block);
      QuantizeQ4_1(f32.data(), n, k, q4_qs.data(), q4_d.data(), q4_m.data());
      // Q5_1: random 5-bit values under float16 scales and minimums, as a file has them.
      std::uniform_int_distribution<uint32_t> bits;
      q5_qs.resize(n * k / 2);
      for (auto& b : q5_qs) b = static_cast<uint8_t>(bits(rng));
      q5_qh.resize(n * k / kQ5Block);
      for (auto& h : q5_qh) h = bits(rng);
      q5_d.resize(q5_qh.size());
      q5_m.resize(q5_qh.size());
      for (size_t b = 0; b < q5_qh.size(); ++b) {
        q5_d[b] = HalfToFloat(FloatToHalf(std::abs(d(rng)) / 16));
        q5_m[b] = HalfToFloat(FloatToHalf(d(rng)));
      }
    }
    if (k % kQ6Super == 0) {
      // Q6_K: random 6-bit values, int8 scales per 16 and float16 d per 256, as a file has them.
      std::uniform_int_distribution<uint32_t> bits;
      q6_ql.resize(n * k / 2);
      for (auto& b : q6_ql) b = static_cast<uint8_t>(bits(rng));
      q6_qh.resize(n * k / 4);
      for (auto& b : q6_qh) b = static_cast<uint8_t>(bits(rng));
      q6_s.resize(n * k / 16);
      for (auto& v : q6_s) v = static_cast<int8_t>(bits(rng));
      for (size_t i = 0; i < q6_s.size(); i += 5) q6_s[i] = -128;  // the extremes
      q6_d.resize(n * k / kQ6Super);
      for (auto& v : q6_d) v = HalfToFloat(FloatToHalf(std::abs(d(rng)) / 512));
    }
    // The tables' rows, each a copy in its own allocation: a kernel that reads past a row's end
    // reads outside it (AddressSanitizer's run reports it), not the next row.
    for (int64_t j = 0; j < n; ++j) {
      f32_row_copies.emplace_back(f32.begin() + j * k, f32.begin() + (j + 1) * k);
      bf16_row_copies.emplace_back(bf16.begin() + j * k, bf16.begin() + (j + 1) * k);
    }
    for (int64_t j = 0; j < n; ++j) {
      f32_rows.push_back(f32_row_copies[j].data());
      bf16_rows.push_back(bf16_row_copies[j].data());
    }
  }
  int64_t n, k;
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<int8_t> q8_qs;
  std::vector<float> q8_scales;
  std::vector<uint8_t> q4_qs;
  std::vector<float> q4_d, q4_m;
  Q4_1Matrix q4() const { return {q4_qs.data(), q4_d.data(), q4_m.data(), n, k}; }
  // The same values and scales as a Q4_0 file's: no minimums, each -8 d.
  Q4_1Matrix q4_0() const { return {q4_qs.data(), q4_d.data(), nullptr, n, k}; }
  std::vector<uint8_t> q5_qs;
  std::vector<uint32_t> q5_qh;
  std::vector<float> q5_d, q5_m;
  Q5_1Matrix q5() const { return {q5_qs.data(), q5_qh.data(), q5_d.data(), q5_m.data(), n, k}; }
  // The same values and scales as a Q5_0 file's: no minimums, each -16 d.
  Q5_1Matrix q5_0() const { return {q5_qs.data(), q5_qh.data(), q5_d.data(), nullptr, n, k}; }
  std::vector<uint8_t> q6_ql, q6_qh;
  std::vector<int8_t> q6_s;
  std::vector<float> q6_d;
  Q6_KMatrix q6() const { return {q6_ql.data(), q6_qh.data(), q6_s.data(), q6_d.data(), n, k}; }
  std::vector<std::vector<float>> f32_row_copies;
  std::vector<std::vector<uint16_t>> bf16_row_copies;
  std::vector<const float*> f32_rows;
  std::vector<const uint16_t*> bf16_rows;
};

enum class Format { kF32, kBf16, kF32Table, kBf16Table, kQ8, kQ4_1, kQ4_0, kQ5_1, kQ5_0, kQ6_K };
const Format kFormats[] = {Format::kF32,  Format::kBf16, Format::kF32Table, Format::kBf16Table,
                           Format::kQ8,   Format::kQ4_1, Format::kQ4_0,     Format::kQ5_1,
                           Format::kQ5_0, Format::kQ6_K};
const Format kBlockFormats[] = {Format::kQ8,   Format::kQ4_1, Format::kQ4_0,
                                Format::kQ5_1, Format::kQ5_0, Format::kQ6_K};

// y[m, n] (+)= x · wᵀ + bias in `format`.
void Multiply(Format format, const Weights& w, const float* x, int64_t ldx, const float* bias,
              float* y, int64_t ldy, int64_t m, bool accumulate) {
  const int64_t n = w.n, k = w.k;
  switch (format) {
    case Format::kF32:
      return GemmRowsF32(x, ldx, w.f32.data(), k, bias, y, ldy, m, n, k, accumulate);
    case Format::kBf16:
      return GemmRowsBf16(x, ldx, w.bf16.data(), bias, y, ldy, m, n, k, accumulate);
    case Format::kF32Table:
      return GemmRowsF32Table(x, ldx, w.f32_rows.data(), bias, y, ldy, m, n, k, accumulate);
    case Format::kBf16Table:
      return GemmRowsBf16Table(x, ldx, w.bf16_rows.data(), bias, y, ldy, m, n, k, accumulate);
    case Format::kQ4_1:
      return GemmRowsQ4_1(x, ldx, w.q4(), bias, y, ldy, m, accumulate);
    case Format::kQ4_0:
      return GemmRowsQ4_1(x, ldx, w.q4_0(), bias, y, ldy, m, accumulate);
    case Format::kQ5_1:
      return GemmRowsQ5_1(x, ldx, w.q5(), bias, y, ldy, m, accumulate);
    case Format::kQ5_0:
      return GemmRowsQ5_1(x, ldx, w.q5_0(), bias, y, ldy, m, accumulate);
    case Format::kQ6_K:
      return GemmRowsQ6_K(x, ldx, w.q6(), bias, y, ldy, m, accumulate);
    case Format::kQ8:
      return GemmRowsQ8(x, ldx, {w.q8_qs.data(), w.q8_scales.data(), n, k}, bias, y, ldy, m,
                        accumulate);
  }
}

// The float the format's kernel multiplies for weight (j, p).
double WeightValue(Format format, const Weights& w, int64_t j, int64_t p) {
  switch (format) {
    case Format::kBf16:
    case Format::kBf16Table:
      return Bf16ToFloat(w.bf16[j * w.k + p]);
    case Format::kQ8:
      return static_cast<double>(static_cast<float>(w.q8_qs[j * w.k + p]) *
                                 w.q8_scales[j * (w.k / kQ8Block) + p / kQ8Block]);
    case Format::kQ4_1: {
      std::vector<float> row(w.k);
      WidenQ4_1Row(w.q4(), j, row.data());
      return row[p];
    }
    case Format::kQ4_0: {  // written out: (q - 8) d
      const int64_t at = j * (w.k / kQ4Block) + p / kQ4Block, o = p % kQ4Block;
      const uint8_t byte = w.q4_qs[at * 16 + o % 16];
      return static_cast<double>((o < 16 ? byte & 15 : byte >> 4) - 8) * w.q4_d[at];
    }
    case Format::kQ5_1:
    case Format::kQ5_0: {
      // Written out here, not through WidenQ5_1Row: bit p % 32 of the block's word is the
      // fifth bit, the nibble is byte p % 16's low (first half) or high (second half) one.
      const int64_t at = j * (w.k / kQ5Block) + p / kQ5Block, o = p % kQ5Block;
      const uint8_t byte = w.q5_qs[at * 16 + o % 16];
      const int q = (o < 16 ? byte & 15 : byte >> 4) | (((w.q5_qh[at] >> o) & 1) << 4);
      if (format == Format::kQ5_0) return static_cast<double>(q - 16) * w.q5_d[at];
      return static_cast<double>(q) * w.q5_d[at] + w.q5_m[at];
    }
    case Format::kQ6_K: {
      // Written out from q6_k.h's layout: group g = (block % 2) + 2 (element >= 16) of the pair.
      const int64_t at = j * (w.k / 32) + p / 32, o = p % 32, g = at % 2 + 2 * (o / 16);
      const uint8_t byte = w.q6_ql[at * 16 + o % 16];
      const int high = (w.q6_qh[(at / 2) * 16 + o % 16] >> (2 * g)) & 3;
      const int q = (o < 16 ? byte & 15 : byte >> 4) | (high << 4);
      return static_cast<double>(w.q6_d[at / 8]) * w.q6_s[(at / 2) * 4 + g] * (q - 32);
    }
    default:
      return w.f32[j * w.k + p];
  }
}

// The block formats multiply activations quantized to 8 bits (kernels/cpu/int8_dot_gemm.cc).
bool QuantizesActivations(Format format) {
  return format == Format::kQ8 || format == Format::kQ4_1 || format == Format::kQ4_0 ||
         format == Format::kQ5_1 || format == Format::kQ5_0 || format == Format::kQ6_K;
}

// The activations the format's kernel multiplies: x itself, or for the block formats x quantized
// per block of 32 (written out here: scale max|x| / 127, values rounded to nearest even, times
// the scale).
std::vector<double> Activations(Format format, const float* x, int64_t k) {
  std::vector<double> out(x, x + k);
  if (!QuantizesActivations(format)) return out;
  for (int64_t b = 0; b < k / 32; ++b) {
    float max = 0.0f;
    for (int64_t p = 32 * b; p < 32 * b + 32; ++p) max = std::max(max, std::abs(x[p]));
    const float scale = max / 127.0f;
    const float inv = scale >= FLT_MIN ? 1.0f / scale : 0.0f;
    for (int64_t p = 32 * b; p < 32 * b + 32; ++p) {
      out[p] = static_cast<double>(scale) * std::nearbyint(x[p] * inv);
    }
  }
  return out;
}

bool Applies(Format format, const Weights& w) {
  if (format == Format::kQ6_K) return !w.q6_ql.empty();
  return !QuantizesActivations(format) || !w.q8_qs.empty();
}

class RowGemm : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const auto [m, n, k] = GetParam();
    std::mt19937 rng(static_cast<unsigned>(m * 131 + n * 7 + k));
    std::normal_distribution<float> d;
    ldx = k + 5;
    ldy = n + 3;
    x.resize(m * ldx);
    for (auto& v : x) v = d(rng);
    bias.resize(n);
    for (auto& v : bias) v = d(rng);
    weights = std::make_unique<Weights>(n, k, static_cast<unsigned>(n + k));
  }
  void TearDown() override { CapIsaForTesting(Isa::kAvx512); }  // back to what the CPU has

  std::vector<float> Run(Format format, int64_t rows, const float* from) {
    std::vector<float> y(rows * ldy, 0.25f);
    Multiply(format, *weights, from, ldx, bias.data(), y.data(), ldy, rows, /*accumulate=*/true);
    return y;
  }

  int64_t ldx = 0, ldy = 0;
  std::vector<float> x, bias;
  std::unique_ptr<Weights> weights;
};

TEST_P(RowGemm, EachFormatMatchesADoubleProductOfItsWeights) {
  const auto [m, n, k] = GetParam();
  for (Format format : kFormats) {
    if (!Applies(format, *weights)) continue;
    const std::vector<float> y = Run(format, m, x.data());
    for (int64_t i = 0; i < m; ++i) {
      const std::vector<double> xi = Activations(format, x.data() + i * ldx, k);
      for (int64_t j = 0; j < n; ++j) {
        double s = 0.25 + bias[j];
        for (int64_t p = 0; p < k; ++p) s += xi[p] * WeightValue(format, *weights, j, p);
        ASSERT_NEAR(y[i * ldy + j], s, 1e-4 * (1 + std::abs(s)))
            << "format " << static_cast<int>(format) << " at " << i << "," << j;
      }
    }
  }
}

// 8-bit activations move each product by at most half a quantization step of x: the output
// stays within sum |w| * scale / 2 of the float32 product (the price of integer dot products,
// as llama.cpp pays it for the same formats).
TEST_P(RowGemm, BlockFormatsStayWithinHalfAnActivationStepOfTheFloatProduct) {
  const auto [m, n, k] = GetParam();
  if (!Applies(Format::kQ5_1, *weights)) GTEST_SKIP() << "k is not a multiple of 32";
  for (Format format : kBlockFormats) {
    if (!Applies(format, *weights)) continue;
    const std::vector<float> y = Run(format, m, x.data());
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x.data() + i * ldx;
      for (int64_t j = 0; j < n; ++j) {
        double exact = 0.25 + bias[j], bound = 0.0;
        for (int64_t b = 0; b < k / 32; ++b) {
          double max = 0.0, weights_abs = 0.0;
          for (int64_t p = 32 * b; p < 32 * b + 32; ++p) {
            const double wv = WeightValue(format, *weights, j, p);
            exact += double(xi[p]) * wv;
            max = std::max(max, std::abs(double(xi[p])));
            weights_abs += std::abs(wv);
          }
          bound += weights_abs * max / 127.0 / 2.0;
        }
        ASSERT_LE(std::abs(y[i * ldy + j] - exact), bound * 1.001 + 1e-4 * (1 + std::abs(exact)))
            << "format " << static_cast<int>(format) << " at " << i << "," << j;
      }
    }
  }
}

TEST_P(RowGemm, EveryRowEqualsItselfMultipliedAlone) {
  const auto [m, n, k] = GetParam();
  for (Format format : kFormats) {
    if (!Applies(format, *weights)) continue;
    const std::vector<float> all = Run(format, m, x.data());
    for (int64_t i = 0; i < m; ++i) {
      const std::vector<float> alone = Run(format, 1, x.data() + i * ldx);
      ASSERT_EQ(std::memcmp(alone.data(), all.data() + i * ldy, n * sizeof(float)), 0)
          << "format " << static_cast<int>(format) << ", row " << i << " of " << m;
    }
  }
}

TEST_P(RowGemm, Avx512KernelsEqualAvx2KernelsBitForBit) {
  if (!CpuHasAvx512()) GTEST_SKIP() << "this CPU has no AVX-512: only the AVX2 kernels run here";
  CapIsaForTesting(Isa::kAvx512);
  if (ActiveIsa() != Isa::kAvx512) GTEST_SKIP() << "INFINIGEN_CPU_ISA=avx2 caps this run";
  const auto [m, n, k] = GetParam();
  for (Format format : kFormats) {
    if (!Applies(format, *weights)) continue;
    CapIsaForTesting(Isa::kAvx2);
    ASSERT_EQ(ActiveIsa(), Isa::kAvx2);
    const std::vector<float> avx2 = Run(format, m, x.data());
    CapIsaForTesting(Isa::kAvx512);
    ASSERT_EQ(ActiveIsa(), Isa::kAvx512);
    const std::vector<float> avx512 = Run(format, m, x.data());
    ASSERT_EQ(std::memcmp(avx2.data(), avx512.data(), avx2.size() * sizeof(float)), 0)
        << "format " << static_cast<int>(format);
  }
}

// Blocks as a Q4_1 file has them (each with a 0 and a 15, as llama.cpp's quantizer makes them),
// decoded to float32 as the GGUF loader decodes them, quantize back to the same bytes; a widened
// row is fma(q, d, m) of each block.
TEST(Q4_1, WeightsDecodedFromAFileQuantizeBackToItsBlocks) {
  std::mt19937 rng(3);
  const int64_t rows = 7, cols = 96, blocks = rows * cols / kQ4Block;
  std::vector<uint8_t> qs(rows * cols / 2);
  std::vector<uint16_t> d(blocks), m(blocks);
  std::vector<float> decoded(rows * cols);
  for (int64_t b = 0; b < blocks; ++b) {
    d[b] = FloatToHalf(std::uniform_real_distribution<float>(1e-4f, 0.05f)(rng));
    m[b] = FloatToHalf(std::uniform_real_distribution<float>(-0.4f, 0.0f)(rng));
    uint8_t q[32];
    for (auto& v : q) v = static_cast<uint8_t>(rng() % 16);
    const int lo = static_cast<int>(rng() % 32), hi = (lo + 1 + static_cast<int>(rng() % 31)) % 32;
    q[lo] = 0;
    q[hi] = 15;
    for (int j = 0; j < 16; ++j) qs[b * 16 + j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
    for (int j = 0; j < 32; ++j) {
      decoded[b * 32 + j] = static_cast<float>(q[j]) * HalfToFloat(d[b]) + HalfToFloat(m[b]);
    }
  }
  std::vector<uint8_t> qs2(qs.size());
  std::vector<float> d2(blocks), m2(blocks);
  QuantizeQ4_1(decoded.data(), rows, cols, qs2.data(), d2.data(), m2.data());
  EXPECT_EQ(qs2, qs);
  for (int64_t b = 0; b < blocks; ++b) {
    ASSERT_EQ(d2[b], HalfToFloat(d[b])) << b;
    ASSERT_EQ(m2[b], HalfToFloat(m[b])) << b;
  }
  std::vector<float> row(cols);
  const Q4_1Matrix w{qs.data(), d2.data(), m2.data(), rows, cols};
  for (int64_t r = 0; r < rows; ++r) {
    WidenQ4_1Row(w, r, row.data());
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t b = (r * cols + c) / 32, j = c % 32;
      const int q = j < 16 ? qs[b * 16 + j] & 15 : qs[b * 16 + j - 16] >> 4;
      ASSERT_EQ(row[c], std::fma(float(q), HalfToFloat(d[b]), HalfToFloat(m[b]))) << r << "," << c;
    }
  }
}

// A NaN or infinite activation makes every output of its row NaN (quantizing it to an integer
// would have hidden it; an infinity's scale would have made it -128), in each block format on
// each instruction set, multiplied alone (GEMV) or with other rows, in a pair of blocks or the
// odd last one; the other rows stay finite.
TEST(BlockFormats, ANonFiniteActivationMakesItsRowsOutputsNaN) {
  // k 96: three blocks, a pair and an odd last one; 256: Q6_K's one super-block.
  for (const int64_t k : {96, 256}) {
    const int64_t n = 9;
    Weights w(n, k, 5);
    for (int64_t at : {40, 70}) {
      for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
        std::vector<float> x(3 * k, 0.5f);
        x[at] = bad;
        for (Format format : kBlockFormats) {
          if (!Applies(format, w)) continue;
          for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
            CapIsaForTesting(isa);
            std::vector<float> y(3 * n, 0.0f), alone(n, 0.0f);
            Multiply(format, w, x.data(), k, nullptr, y.data(), n, 3, false);
            Multiply(format, w, x.data(), k, nullptr, alone.data(), n, 1, false);
            for (int64_t j = 0; j < n; ++j) {
              const std::string where = std::to_string(static_cast<int>(format)) + " at " +
                                        std::to_string(at) + " = " + std::to_string(bad) + ", " +
                                        std::to_string(j);
              EXPECT_TRUE(std::isnan(y[j])) << where;
              EXPECT_TRUE(std::isnan(alone[j])) << where;
              EXPECT_TRUE(std::isfinite(y[n + j]) && std::isfinite(y[2 * n + j])) << where;
            }
          }
        }
      }
    }
  }
  CapIsaForTesting(Isa::kAvx512);
}

// A Q5_0 or Q4_0 matrix that keeps no minimums gives the bits of the same matrix whose
// minimums are stored as -16 d or -8 d (what the loader kept before kQ5_0 and kQ4_0): widened,
// and multiplied by the GEMV and the panels under each instruction set this CPU has.
TEST(CenteredBlocks, NoMinimumsGiveTheBitsOfStoredOnes) {
  const int64_t n = 53, k = 576;
  const Weights w(n, k, 9);
  std::vector<float> q5_m(w.q5_d.size()), q4_m(w.q4_d.size());
  for (size_t b = 0; b < q5_m.size(); ++b) q5_m[b] = -16.0f * w.q5_d[b];
  for (size_t b = 0; b < q4_m.size(); ++b) q4_m[b] = -8.0f * w.q4_d[b];
  const Q5_1Matrix q5{w.q5_qs.data(), w.q5_qh.data(), w.q5_d.data(), q5_m.data(), n, k};
  const Q4_1Matrix q4{w.q4_qs.data(), w.q4_d.data(), q4_m.data(), n, k};
  std::vector<float> a(k), b(k), c(k), e(k);
  for (int64_t r = 0; r < n; ++r) {
    WidenQ5_1Row(q5, r, a.data());
    WidenQ5_1Row(w.q5_0(), r, b.data());
    ASSERT_EQ(std::memcmp(a.data(), b.data(), k * sizeof(float)), 0) << "Q5_0 row " << r;
    WidenQ4_1Row(q4, r, c.data());
    WidenQ4_1Row(w.q4_0(), r, e.data());
    ASSERT_EQ(std::memcmp(c.data(), e.data(), k * sizeof(float)), 0) << "Q4_0 row " << r;
  }
  std::mt19937 rng(4);
  std::normal_distribution<float> d;
  std::vector<Isa> isas = {Isa::kAvx2};
  if (CpuHasAvx512()) isas.push_back(Isa::kAvx512);
  for (Isa isa : isas) {
    CapIsaForTesting(isa);
    for (int64_t m : {1, 3, 70}) {
      std::vector<float> x(m * k);
      for (auto& v : x) v = d(rng);
      std::vector<float> want(m * n, 0.5f), got(m * n, 0.5f);
      GemmRowsQ5_1(x.data(), k, q5, nullptr, want.data(), n, m, /*accumulate=*/true);
      GemmRowsQ5_1(x.data(), k, w.q5_0(), nullptr, got.data(), n, m, /*accumulate=*/true);
      ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
          << "Q5_0, " << m << " rows, isa " << static_cast<int>(isa);
      GemmRowsQ4_1(x.data(), k, q4, nullptr, want.data(), n, m, /*accumulate=*/true);
      GemmRowsQ4_1(x.data(), k, w.q4_0(), nullptr, got.data(), n, m, /*accumulate=*/true);
      ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
          << "Q4_0, " << m << " rows, isa " << static_cast<int>(isa);
    }
  }
  CapIsaForTesting(CpuHasAvx512() ? Isa::kAvx512 : Isa::kAvx2);
}

// A weight stacked from parts of different block formats, multiplied as one job, equals each
// part multiplied alone bit for bit: a row count that takes the GEMV, one that takes the panels,
// parts of every format (two layouts of x) in an order that mixes them, odd part sizes.
TEST(GemmRowsParts, EqualsEachPartMultipliedAloneBitForBit) {
  const int64_t k = 512;
  const int64_t rows[] = {97, 13, 50, 211, 1, 33, 17};
  const Format formats[] = {Format::kQ5_1, Format::kQ8,   Format::kQ6_K, Format::kQ4_1,
                            Format::kQ5_1, Format::kQ5_0, Format::kQ4_0};
  std::vector<std::unique_ptr<Weights>> weights;
  int64_t n = 0;
  for (size_t i = 0; i < std::size(rows); ++i) {
    weights.push_back(std::make_unique<Weights>(rows[i], k, static_cast<unsigned>(31 + i)));
    n += rows[i];
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> d;
  std::vector<float> bias(n);
  for (auto& v : bias) v = d(rng);
  for (int64_t m : {1, 3, 70}) {
    for (bool accumulate : {false, true}) {
      const int64_t ldx = k + 3, ldy = n + 7;
      std::vector<float> x(m * ldx);
      for (auto& v : x) v = d(rng);
      std::vector<float> alone(m * ldy, 0.5f), together(m * ldy, 0.5f);
      std::vector<BlockPart> parts;
      int64_t c0 = 0;
      for (size_t i = 0; i < std::size(rows); ++i) {
        const Weights& w = *weights[i];
        Multiply(formats[i], w, x.data(), ldx, bias.data() + c0, alone.data() + c0, ldy, m,
                 accumulate);
        BlockPart part{Q8Matrix{}, bias.data() + c0, together.data() + c0};
        switch (formats[i]) {
          case Format::kQ8:
            part.matrix = Q8Matrix{w.q8_qs.data(), w.q8_scales.data(), w.n, w.k};
            break;
          case Format::kQ4_1:
            part.matrix = w.q4();
            break;
          case Format::kQ5_1:
            part.matrix = w.q5();
            break;
          case Format::kQ5_0:
            part.matrix = w.q5_0();
            break;
          case Format::kQ4_0:
            part.matrix = w.q4_0();
            break;
          default:
            part.matrix = w.q6();
        }
        parts.push_back(part);
        c0 += rows[i];
      }
      GemmRowsParts(x.data(), ldx, parts, ldy, m, accumulate);
      ASSERT_EQ(std::memcmp(alone.data(), together.data(), alone.size() * sizeof(float)), 0)
          << m << " rows, accumulate " << accumulate;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(OddSizes, RowGemm,
                         ::testing::Values(Case{1, 1, 7}, Case{1, 5, 8}, Case{1, 50, 40},
                                           Case{1, 97, 576}, Case{2, 49, 24}, Case{3, 13, 64},
                                           Case{5, 50, 96}, Case{7, 101, 67}, Case{70, 53, 160},
                                           Case{130, 9, 32}, Case{1, 37, 256}, Case{1, 97, 1536},
                                           Case{3, 21, 512}, Case{70, 19, 768},
                                           // 16 x rows and more: k with an odd 8-element
                                           // block and a tail, under 8, every m % 3, weight
                                           // rows past a multiple of 8
                                           Case{20, 37, 67}, Case{16, 19, 40}, Case{33, 50, 24},
                                           Case{17, 5, 7}));

}  // namespace
}  // namespace infinigen::cpu
