// Every GGUF block format decoded against the `gguf` package's reference dequantizer
// (scripts/fixtures/make_quant_fixtures.py): random blocks of each format, real tensors of the
// SmolLM2 GGUF, and rows of tensors llama.cpp's quantizer wrote in K-quants. The 4-bit formats'
// conversion to Q4_1 blocks, theirs and the 5-bit formats' to Q5_1 blocks, and Q6_K's and
// Q3_K's to the CPU's Q6_K layout give the same values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/mapped_file.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/model/gguf.h"
#include "gpu_worker/model/stacked_tensors.h"
#include "gpu_worker/model/storage_type.h"
#include "kernels/cpu/q4_1.h"
#include "kernels/cpu/q5_1.h"
#include "kernels/cpu/q6_k.h"
#include "nlohmann/json.hpp"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

using testing::FixturePath;
using testing::NpyFloats;

const char* const kFormats[] = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};

// Bitwise comparison (or by value, where +0 and -0 count as equal); reports the first few
// differences.
void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want,
                    const std::string& what, bool zero_sign_matters = true) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size() && reported < 5; ++i) {
    const bool same =
        zero_sign_matters ? std::memcmp(&got[i], &want[i], 4) == 0 : got[i] == want[i];
    if (!same) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", the reference "
                    << want[i];
      ++reported;
    }
  }
}

struct Loaded {
  MappedFile file;
  GgufFile gguf;
};

Loaded Open(const std::string& path) {
  auto file = MappedFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  auto gguf = GgufFile::Parse(*file);
  EXPECT_TRUE(gguf.ok()) << gguf.status();
  return {std::move(*file), std::move(*gguf)};
}

const StoredTensor* Find(const GgufFile& g, const std::string& name) {
  for (const StoredTensor& t : g.tensors) {
    if (t.file_name == name) return &t;
  }
  return nullptr;
}

TEST(GgufQuants, EveryFormatDecodesAsTheReference) {
  for (const char* format : kFormats) {
    SCOPED_TRACE(format);
    Loaded l = Open(FixturePath(std::string("quants/") + format + ".gguf"));
    ASSERT_EQ(l.gguf.tensors.size(), 1u);
    const StoredTensor& t = l.gguf.tensors[0];
    EXPECT_EQ(StorageTypeName(t.type), format);
    ASSERT_EQ(t.shape, (std::vector<int64_t>{3, 512}));
    std::vector<float> got(t.NumElements());
    DecodeToFloat(t, got.data());
    ExpectSameBits(got, NpyFloats(FixturePath(std::string("quants/") + format + ".npy")), format);
  }
}

// A [rows, cols] tensor of a Q4_1-convertible type converted to Q4_1 blocks and widened back.
std::vector<float> ConvertedAndWidened(const StoredTensor& t) {
  const int64_t rows = t.shape[0], cols = t.shape[1], blocks = rows * cols / cpu::kQ4Block;
  std::vector<uint8_t> qs(blocks * 16);
  std::vector<float> d(blocks), m(blocks);
  ConvertToQ4_1(t.type, t.data, t.NumElements() / StorageBlockElements(t.type), qs.data(), d.data(),
                m.data());
  const cpu::Q4_1Matrix q{qs.data(), d.data(), m.data(), rows, cols};
  std::vector<float> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) cpu::WidenQ4_1Row(q, r, out.data() + r * cols);
  return out;
}

// The same through Q5_1 blocks.
std::vector<float> ConvertedToQ5_1AndWidened(const StoredTensor& t) {
  const int64_t rows = t.shape[0], cols = t.shape[1], blocks = rows * cols / cpu::kQ5Block;
  std::vector<uint8_t> qs(blocks * 16);
  std::vector<uint32_t> qh(blocks, 0xdeadbeef);
  std::vector<float> d(blocks), m(blocks);
  ConvertToQ5_1(t.type, t.data, t.NumElements() / StorageBlockElements(t.type), qs.data(),
                qh.data(), d.data(), m.data());
  const cpu::Q5_1Matrix q{qs.data(), qh.data(), d.data(), m.data(), rows, cols};
  std::vector<float> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) cpu::WidenQ5_1Row(q, r, out.data() + r * cols);
  return out;
}

// The same through the CPU's Q6_K layout.
std::vector<float> ConvertedToQ6_KAndWidened(const StoredTensor& t) {
  const int64_t rows = t.shape[0], cols = t.shape[1], n = rows * cols;
  std::vector<uint8_t> ql(n / 2, 0xee), qh(n / 4, 0xee);
  std::vector<int8_t> s(n / 16, 99);
  std::vector<float> d(n / cpu::kQ6Super, -1.0f);
  ConvertToQ6_K(t.type, t.data, n / StorageBlockElements(t.type), ql.data(), qh.data(), s.data(),
                d.data());
  const cpu::Q6_KMatrix q{ql.data(), qh.data(), s.data(), d.data(), rows, cols};
  std::vector<float> out(n);
  for (int64_t r = 0; r < rows; ++r) cpu::WidenQ6_KRow(q, r, out.data() + r * cols);
  return out;
}

bool IsOneOf(const std::string& format, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (format == n) return true;
  }
  return false;
}

TEST(GgufQuants, FourAndFiveBitFormatsConvertToQ5_1Exactly) {
  for (const char* format : kFormats) {
    SCOPED_TRACE(format);
    Loaded l = Open(FixturePath(std::string("quants/") + format + ".gguf"));
    const StoredTensor& t = l.gguf.tensors[0];
    const bool converts = ConvertsToQ5_1(t.type);
    EXPECT_EQ(converts, IsOneOf(format, {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K"}));
    if (!converts) continue;
    // (16 - 16) * d is -0 for a negative d, fma(16, d, -16d) is +0: equal values.
    ExpectSameBits(ConvertedToQ5_1AndWidened(t),
                   NpyFloats(FixturePath(std::string("quants/") + format + ".npy")), format,
                   /*zero_sign_matters=*/false);
  }
}

TEST(GgufQuants, Q6_KAndQ3_KConvertToTheCpuQ6_KLayoutExactly) {
  for (const char* format : kFormats) {
    SCOPED_TRACE(format);
    Loaded l = Open(FixturePath(std::string("quants/") + format + ".gguf"));
    const StoredTensor& t = l.gguf.tensors[0];
    EXPECT_EQ(ConvertsToQ6_K(t.type), IsOneOf(format, {"Q6_K", "Q3_K"}));
    if (!ConvertsToQ6_K(t.type)) continue;
    ExpectSameBits(ConvertedToQ6_KAndWidened(t),
                   NpyFloats(FixturePath(std::string("quants/") + format + ".npy")), format);
  }
}

TEST(GgufQuants, FourBitFormatsConvertToQ4_1Exactly) {
  for (const char* format : kFormats) {
    SCOPED_TRACE(format);
    Loaded l = Open(FixturePath(std::string("quants/") + format + ".gguf"));
    const StoredTensor& t = l.gguf.tensors[0];
    const bool converts = ConvertsToQ4_1(t.type);
    EXPECT_EQ(converts, format == std::string("Q4_0") || format == std::string("Q4_1") ||
                            format == std::string("Q4_K"));
    if (!converts) continue;
    // Q4_0's (8 - 8) * d is -0 for a negative d, fma(8, d, -8d) is +0: equal values.
    ExpectSameBits(ConvertedAndWidened(t),
                   NpyFloats(FixturePath(std::string("quants/") + format + ".npy")), format,
                   /*zero_sign_matters=*/false);
  }
}

TEST(GgufQuants, BlocksLlamaCppQuantizedDecodeAsTheReference) {
  // Rows of real tensors that llama.cpp's quantizer wrote (SmolLM2 requantized to Q4_K_M).
  std::ifstream in(FixturePath("quants/real.json"));
  const nlohmann::json meta = nlohmann::json::parse(in);
  ASSERT_TRUE(meta["tensors"].contains("Q4_K") && meta["tensors"].contains("Q6_K"));
  for (const auto& [format, name] : meta["tensors"].items()) {
    SCOPED_TRACE(format);
    Loaded l = Open(FixturePath("quants/real_" + format + ".gguf"));
    const StoredTensor* t = Find(l.gguf, name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(StorageTypeName(t->type), format);
    std::vector<float> got(t->NumElements());
    DecodeToFloat(*t, got.data());
    const std::vector<float> want = NpyFloats(FixturePath("quants/real_" + format + ".npy"));
    ExpectSameBits(got, want, format);
    if (ConvertsToQ5_1(t->type)) {
      ExpectSameBits(ConvertedToQ5_1AndWidened(*t), want, format + " as Q5_1",
                     /*zero_sign_matters=*/false);
    }
    if (ConvertsToQ6_K(t->type)) {
      ExpectSameBits(ConvertedToQ6_KAndWidened(*t), want, format + " in the CPU's Q6_K layout");
    }
    if (!ConvertsToQ4_1(t->type)) continue;
    ExpectSameBits(ConvertedAndWidened(*t), want, format + " as Q4_1", /*zero_sign_matters=*/false);
  }
}

// Rows `ids` of a weight as the CPU backend stores it, widened back to float32.
std::vector<float> EmbeddedRows(CpuBackend& cpu, const Weight& w, const std::vector<int32_t>& ids) {
  std::vector<float> out(ids.size() * w.cols);
  const MatView view{out.data(), DType::kF32, static_cast<int64_t>(ids.size()), w.cols, w.cols};
  EXPECT_TRUE(cpu.Embedding(w, ids.data(), view).ok());
  return out;
}

TEST(GgufQuants, CpuBackendKeepsEachFilesValuesUnderQ4_1) {
  // Q5_0 and Q4_0 in Q5_1 and Q4_1 blocks without minimums (kQ5_0, kQ4_0): the kernels make
  // -16 d and -8 d for each.
  for (const auto& [format, kept] :
       {std::pair{"Q4_K", WeightFormat::kQ4_1}, std::pair{"Q4_0", WeightFormat::kQ4_0},
        std::pair{"Q4_1", WeightFormat::kQ4_1}, std::pair{"Q6_K", WeightFormat::kQ6_K},
        std::pair{"Q3_K", WeightFormat::kQ6_K}, std::pair{"Q5_0", WeightFormat::kQ5_0},
        std::pair{"Q5_1", WeightFormat::kQ5_1}, std::pair{"Q5_K", WeightFormat::kQ5_1}}) {
    SCOPED_TRACE(format);
    Loaded l = Open(FixturePath(std::string("quants/") + format + ".gguf"));
    const StoredTensor& t = l.gguf.tensors[0];
    // The tensor stacked after itself: the second copy's blocks (Q6_K: super-blocks, pairs and
    // scales) land after the first's.
    CpuBackendOptions options;
    options.weight_format = WeightFormat::kQ4_1;
    CpuBackend cpu(options);
    auto w = cpu.UploadStoredWeight(StackedTensors({&t, &t}, 6, 512));
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->format, kept);
    if (kept == WeightFormat::kQ5_0) {  // 24 bytes a block of 32 (and two 64-byte alignments)
      EXPECT_LE(w->buffer->size(), 6 * 512 / 32 * 24 + 128);
    }
    if (kept == WeightFormat::kQ4_0) {  // 20 bytes a block of 32 (and a 64-byte alignment)
      EXPECT_LE(w->buffer->size(), 6 * 512 / 32 * 20 + 64);
    }
    std::vector<float> want = NpyFloats(FixturePath(std::string("quants/") + format + ".npy"));
    want.insert(want.end(), want.begin(), want.end());
    // The 4- and 5-bit blocks' fma(q, d, m) is +0 where the reference's (q - 16) d, (q - 8) d or
    // q d + m may be -0; the K-quants kept as Q4_1 and Q6_K give the reference's zeros exactly.
    const std::string name = format;
    ExpectSameBits(EmbeddedRows(cpu, *w, {0, 1, 2, 3, 4, 5}), want, format,
                   /*zero_sign_matters=*/name == "Q4_K" || name == "Q6_K" || name == "Q3_K");
    EXPECT_EQ(cpu.Name(), "cpu-q4_1");
  }
}

TEST(GgufQuants, CpuBackendKeepsFiveBitValuesUnderQ4_1InQ5_1Blocks) {
  // Q5_0 stacked on Q5_K and Q4_K (a fused QKV of mixed types): one Q5_1 matrix, exact.
  Loaded q5_0 = Open(FixturePath("quants/Q5_0.gguf"));
  Loaded q5_k = Open(FixturePath("quants/Q5_K.gguf"));
  Loaded q4_k = Open(FixturePath("quants/Q4_K.gguf"));
  CpuBackendOptions options;
  options.weight_format = WeightFormat::kQ4_1;
  CpuBackend cpu(options);
  auto w = cpu.UploadStoredWeight(StackedTensors(
      {&q5_0.gguf.tensors[0], &q5_k.gguf.tensors[0], &q4_k.gguf.tensors[0]}, 9, 512));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->format, WeightFormat::kQ5_1);
  std::vector<float> want;
  for (const char* f : {"Q5_0", "Q5_K", "Q4_K"}) {
    const std::vector<float> v = NpyFloats(FixturePath(std::string("quants/") + f + ".npy"));
    want.insert(want.end(), v.begin(), v.end());
  }
  ExpectSameBits(EmbeddedRows(cpu, *w, {0, 1, 2, 3, 4, 5, 6, 7, 8}), want, "as Q5_1",
                 /*zero_sign_matters=*/false);
  EXPECT_EQ(cpu.Name(), "cpu-q4_1");
}

// y = x . w^T + bias for a [rows, 512] weight, x: 3 rows.
std::vector<float> Multiplied(CpuBackend& cpu, const Weight& w, const std::vector<float>& x,
                              const Weight* bias) {
  std::vector<float> y(3 * w.rows, 0.0f);
  const absl::Status st =
      cpu.Linear(MatView{const_cast<float*>(x.data()), DType::kF32, 3, 512, 512}, w, bias,
                 MatView{y.data(), DType::kF32, 3, w.rows, w.rows}, /*accumulate=*/false);
  EXPECT_TRUE(st.ok()) << st;
  return y;
}

TEST(GgufQuants, CpuBackendKeepsEachPartOfAMixedStackInItsOwnLayout) {
  // A fused QKV as a Q4_K_M file has it: Q and K in Q5_0, V in Q8_0 (no one kept layout holds
  // all three), then Q5_0 on Q6_K and Q3_K: segments of consecutive parts that share a layout.
  Loaded q5_0 = Open(FixturePath("quants/Q5_0.gguf"));
  Loaded q8_0 = Open(FixturePath("quants/Q8_0.gguf"));
  Loaded q6_k = Open(FixturePath("quants/Q6_K.gguf"));
  Loaded q3_k = Open(FixturePath("quants/Q3_K.gguf"));
  const StoredTensor *a = &q5_0.gguf.tensors[0], *v = &q8_0.gguf.tensors[0],
                     *six = &q6_k.gguf.tensors[0], *three = &q3_k.gguf.tensors[0];
  CpuBackendOptions options;
  options.weight_format = WeightFormat::kQ4_1;
  CpuBackend cpu(options);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> x(3 * 512);
  for (float& f : x) f = normal(rng);
  for (const auto& [parts, formats] :
       {std::pair{std::vector<const StoredTensor*>{a, a, v},
                  std::vector<WeightFormat>{WeightFormat::kQ5_0, WeightFormat::kQ8}},
        std::pair{std::vector<const StoredTensor*>{a, six, three},
                  std::vector<WeightFormat>{WeightFormat::kQ5_0, WeightFormat::kQ6_K}}}) {
    const StackedTensors stacked(parts, 3 * static_cast<int64_t>(parts.size()), 512);
    auto w = cpu.UploadStoredWeight(stacked);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_EQ(w->segments.size(), formats.size());
    for (size_t i = 0; i < formats.size(); ++i) EXPECT_EQ(w->segments[i].format, formats[i]);
    // Each segment multiplied alone fills its columns of the whole product, bit for bit, bias
    // included; and the whole is the float32 product of the file's values within the 8-bit
    // activations' error.
    std::vector<float> bias_values(w->rows);
    for (float& f : bias_values) f = normal(rng);
    auto bias = cpu.UploadWeight(bias_values.data(), 1, w->rows);
    ASSERT_TRUE(bias.ok());
    const std::vector<float> y = Multiplied(cpu, *w, x, &*bias);
    int64_t r0 = 0;
    for (const Weight& part : w->segments) {
      auto part_bias = cpu.UploadWeight(bias_values.data() + r0, 1, part.rows);
      ASSERT_TRUE(part_bias.ok());
      const std::vector<float> alone = Multiplied(cpu, part, x, &*part_bias);
      for (int64_t i = 0; i < 3; ++i) {
        for (int64_t j = 0; j < part.rows; ++j) {
          ASSERT_EQ(alone[i * part.rows + j], y[i * w->rows + r0 + j]) << i << "," << r0 + j;
        }
      }
      r0 += part.rows;
    }
    std::vector<float> values(w->rows * 512);
    stacked.Decode(0, w->rows, values.data());
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t j = 0; j < w->rows; ++j) {
        double want = bias_values[j], scale = 0.0;
        for (int64_t k = 0; k < 512; ++k) {
          want += double(x[i * 512 + k]) * values[j * 512 + k];
          scale += std::abs(double(x[i * 512 + k]) * values[j * 512 + k]);
        }
        EXPECT_NEAR(y[i * w->rows + j], want, 0.02 * scale + 1e-5) << i << "," << j;
      }
    }
  }
  EXPECT_EQ(cpu.Name(), "cpu-q4_1");
}

TEST(GgufQuants, CpuBackendMultipliesQ4_0AndQ5_0AsWithStoredMinimums) {
  // A file's Q4_0 (Q5_0) matrix alone is kept without minimums (kQ4_0, kQ5_0); stacked with a
  // Q4_1 (Q5_1) part it is kept in Q4_1 (Q5_1) blocks with m = -8 d (-16 d) stored. Linear gives
  // the same bits either way, on the file's own blocks, and the product of the file's values.
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> x(3 * 512);
  for (float& f : x) f = normal(rng);
  for (const auto& [bare, summed, alone, stacked] :
       {std::tuple{"Q4_0", "Q4_1", WeightFormat::kQ4_0, WeightFormat::kQ4_1},
        std::tuple{"Q5_0", "Q5_1", WeightFormat::kQ5_0, WeightFormat::kQ5_1}}) {
    SCOPED_TRACE(bare);
    Loaded a = Open(FixturePath(std::string("quants/") + bare + ".gguf"));
    Loaded b = Open(FixturePath(std::string("quants/") + summed + ".gguf"));
    const StoredTensor *t = &a.gguf.tensors[0], *u = &b.gguf.tensors[0];
    CpuBackendOptions options;
    options.weight_format = WeightFormat::kQ4_1;
    CpuBackend cpu(options);
    const StackedTensors one({t}, 3, 512);
    auto w = cpu.UploadStoredWeight(one);
    auto with_m = cpu.UploadStoredWeight(StackedTensors({t, u}, 6, 512));
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(with_m.ok()) << with_m.status();
    ASSERT_EQ(w->format, alone);
    ASSERT_EQ(with_m->format, stacked);
    const std::vector<float> y = Multiplied(cpu, *w, x, nullptr);
    const std::vector<float> y_m = Multiplied(cpu, *with_m, x, nullptr);
    std::vector<float> values(3 * 512);
    one.Decode(0, 3, values.data());
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t j = 0; j < 3; ++j) {
        ASSERT_EQ(y[i * 3 + j], y_m[i * 6 + j]) << i << "," << j;
        double want = 0.0, scale = 0.0;
        for (int64_t k = 0; k < 512; ++k) {
          want += double(x[i * 512 + k]) * values[j * 512 + k];
          scale += std::abs(double(x[i * 512 + k]) * values[j * 512 + k]);
        }
        EXPECT_NEAR(y[i * 3 + j], want, 0.02 * scale + 1e-5) << i << "," << j;
      }
    }
  }
}

TEST(GgufQuants, CpuBackendPacksLargeMatricesARowBlockAtATime) {
  // 600 rows of 512: more than one block of rows is decoded and quantized (q8) or converted
  // (bf16); each row must come back as its own values, within the format's rounding.
  Loaded l = Open(FixturePath("quants/Q6_K.gguf"));
  const StoredTensor& t = l.gguf.tensors[0];
  std::vector<const StoredTensor*> parts(200, &t);
  const std::vector<float> one = NpyFloats(FixturePath("quants/Q6_K.npy"));
  for (WeightFormat format : {WeightFormat::kQ8, WeightFormat::kBF16, WeightFormat::kF32}) {
    SCOPED_TRACE(WeightFormatName(format));
    CpuBackendOptions options;
    options.weight_format = format;
    CpuBackend cpu(options);
    auto w = cpu.UploadStoredWeight(StackedTensors(parts, 600, 512));
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->format, format);
    const std::vector<int32_t> ids = {0, 1, 2, 298, 511, 512, 513, 599};
    const std::vector<float> got = EmbeddedRows(cpu, *w, ids);
    for (size_t i = 0; i < ids.size(); ++i) {
      const float* want = one.data() + (ids[i] % 3) * 512;
      float amax = 0.0f;
      for (int j = 0; j < 512; ++j) amax = std::max(amax, std::fabs(want[j]));
      for (int j = 0; j < 512; ++j) {
        ASSERT_NEAR(got[i * 512 + j], want[j], format == WeightFormat::kF32 ? 0.0f : amax / 100)
            << "row " << ids[i] << " element " << j;
      }
    }
  }
}

TEST(GgufQuants, RealSmolLm2TensorsDecodeAsTheReference) {
  const std::string path = testing::SmolLm2Path();
  IG_REQUIRE_FILE(path, "SmolLM2 GGUF");
  std::ifstream in(FixturePath("quants/smollm2.json"));
  const nlohmann::json meta = nlohmann::json::parse(in);
  const int64_t rows = meta["rows"];
  Loaded l = Open(path);
  ASSERT_FALSE(meta["tensors"].empty());
  for (const auto& [format, name] : meta["tensors"].items()) {
    SCOPED_TRACE(name.get<std::string>());
    const StoredTensor* t = Find(l.gguf, name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(StorageTypeName(t->type), format);
    const int64_t cols = t->shape.back();
    std::vector<float> got(rows * cols);
    DecodeBlocks(t->type, t->data, rows * cols / StorageBlockElements(t->type), got.data());
    ExpectSameBits(got, NpyFloats(FixturePath("quants/smollm2_" + format + ".npy")), format);
  }
}

}  // namespace
}  // namespace infinigen
