// Matrix-vector products of a decode step on the CPU, per weight format, at SmolLM2 and
// Llama-3.2-1B shapes. Reports weight bytes streamed per second next to the memory bandwidth
// a plain read of the same bytes reaches (the roofline for memory-bound decode).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/packed_gemm.h"
#include "kernels/cpu/q4_1.h"
#include "kernels/cpu/q5_1.h"
#include "kernels/cpu/row_gemm.h"

namespace infinigen::cpu {
namespace {

struct Problem {
  std::vector<float> x, w, y;
  std::vector<uint16_t> w_bf16;
  std::vector<int8_t> qs;
  std::vector<float> scales;
  // Q4_1 of w, and Q5_1 blocks of random 5-bit values (what a file's Q5_0 matrix becomes).
  std::vector<uint8_t> q4_qs, q5_qs;
  std::vector<uint32_t> q5_qh;
  std::vector<float> q4_d, q4_m, q5_d, q5_m;
  // Q6_K layout (q6_k.h) of random 6-bit values and scales (k a multiple of 256; else empty).
  std::vector<uint8_t> q6_ql, q6_qh;
  std::vector<int8_t> q6_s;
  std::vector<float> q6_d;
  int64_t n, k;

  Problem(int64_t n_, int64_t k_) : n(n_), k(k_) {
    std::mt19937 rng(1);
    std::normal_distribution<float> d;
    x.resize(k);
    w.resize(n * k);
    y.resize(n);
    for (auto& v : x) v = d(rng);
    for (auto& v : w) v = d(rng);
    w_bf16.resize(n * k);
    ConvertFromFloat(w.data(), DType::kBF16, w_bf16.data(), w.size());
    qs.resize(n * k);
    scales.resize(n * k / kQ8Block);
    QuantizeQ8(w.data(), n, k, qs.data(), scales.data());
    const int64_t blocks = n * k / kQ4Block;
    q4_qs.resize(n * k / 2);
    q4_d.resize(blocks);
    q4_m.resize(blocks);
    QuantizeQ4_1(w.data(), n, k, q4_qs.data(), q4_d.data(), q4_m.data());
    q5_qs.resize(n * k / 2);
    q5_qh.resize(blocks);
    q5_d.resize(blocks);
    q5_m.resize(blocks);
    for (auto& b : q5_qs) b = static_cast<uint8_t>(rng());
    for (int64_t b = 0; b < blocks; ++b) {
      q5_qh[b] = static_cast<uint32_t>(rng());
      q5_d[b] = 0.01f;
      q5_m[b] = -0.16f;
    }
    if (k % kQ6Super == 0) {
      q6_ql.resize(n * k / 2);
      q6_qh.resize(n * k / 4);
      q6_s.resize(n * k / 16);
      q6_d.assign(n * k / kQ6Super, 0.001f);
      for (auto& b : q6_ql) b = static_cast<uint8_t>(rng());
      for (auto& b : q6_qh) b = static_cast<uint8_t>(rng());
      for (auto& v : q6_s) v = static_cast<int8_t>(rng());
    }
  }
};

void SetBytes(benchmark::State& state, int64_t bytes) {
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_GemvF32(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  for (auto _ : state) {
    Gemm(p.x.data(), p.k, p.w.data(), p.k, nullptr, p.y.data(), p.n, 1, p.n, p.k, false);
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, p.n * p.k * 4);
}

void BM_GemvBf16(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  for (auto _ : state) {
    GemmBf16(p.x.data(), p.k, p.w_bf16.data(), nullptr, p.y.data(), p.n, 1, p.n, p.k, false);
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, p.n * p.k * 2);
}

// The batch-invariant kernels (kernels/cpu/row_gemm.h) the CPU backend uses by default.
void BM_GemvRowsF32(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  for (auto _ : state) {
    GemmRowsF32(p.x.data(), p.k, p.w.data(), p.k, nullptr, p.y.data(), p.n, 1, p.n, p.k, false);
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, p.n * p.k * 4);
}

void BM_GemvRowsBf16(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  for (auto _ : state) {
    GemmRowsBf16(p.x.data(), p.k, p.w_bf16.data(), nullptr, p.y.data(), p.n, 1, p.n, p.k, false);
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, p.n * p.k * 2);
}

void BM_GemvRowsQ8(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  const Q8Matrix m{p.qs.data(), p.scales.data(), p.n, p.k};
  for (auto _ : state) {
    GemmRowsQ8(p.x.data(), p.k, m, nullptr, p.y.data(), p.n, 1, false);
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, p.n * p.k + p.n * p.k / kQ8Block * 4);
}

void BM_GemvRowsQ4_1(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  const Q4_1Matrix m{p.q4_qs.data(), p.q4_d.data(), p.q4_m.data(), p.n, p.k};
  for (auto _ : state) {
    GemmRowsQ4_1(p.x.data(), p.k, m, nullptr, p.y.data(), p.n, 1, false);
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, p.n * p.k / 2 + p.n * p.k / kQ4Block * 8);
}

void BM_GemvRowsQ5_1(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  const Q5_1Matrix m{p.q5_qs.data(), p.q5_qh.data(), p.q5_d.data(), p.q5_m.data(), p.n, p.k};
  for (auto _ : state) {
    GemmRowsQ5_1(p.x.data(), p.k, m, nullptr, p.y.data(), p.n, 1, false);
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, p.n * p.k / 2 + p.n * p.k / kQ5Block * 12);
}

void BM_GemvRowsQ6_K(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  const Q6_KMatrix m{p.q6_ql.data(), p.q6_qh.data(), p.q6_s.data(), p.q6_d.data(), p.n, p.k};
  for (auto _ : state) {
    GemmRowsQ6_K(p.x.data(), p.k, m, nullptr, p.y.data(), p.n, 1, false);
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, p.n * p.k / 2 + p.n * p.k / 4 + p.n * p.k / 16 + p.n * p.k / kQ6Super * 4);
}

void BM_GemvQ8(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  Q8Matrix m{p.qs.data(), p.scales.data(), p.n, p.k};
  for (auto _ : state) {
    GemmQ8(p.x.data(), p.k, m, nullptr, p.y.data(), p.n, 1, false);
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, p.n * p.k + p.n * p.k / kQ8Block * 4);
}

// A plain sum over the same number of bytes as the Q8 weights: the bandwidth roofline.
void BM_ReadBandwidth(benchmark::State& state) {
  const int64_t bytes = state.range(0) * state.range(1);
  std::vector<float> buf(bytes / 4, 1.0f);
  const int64_t chunks = static_cast<int64_t>(buf.size()) / 16;
  for (auto _ : state) {
    float total = 0;
#pragma omp parallel for reduction(+ : total)
    for (int64_t c = 0; c < chunks; ++c) {
      float lane[16];
      for (int j = 0; j < 16; ++j) lane[j] = buf[c * 16 + j];  // one 64-byte line per chunk
      for (int j = 1; j < 16; ++j) lane[0] += lane[j];
      total += lane[0];
    }
    benchmark::DoNotOptimize(total);
  }
  SetBytes(state, bytes);
}

// A decode step's pattern: many GEMVs in a row, each on a matrix that is not in any cache
// (60 matrices of [3072, 576] = 106 MB in Q8), so every call pays its own stream ramp-up.
void BM_GemvQ8Sequence(benchmark::State& state) {
  const int64_t n = 3072, k = 576, count = 60;
  Problem p(n, k);
  std::vector<std::vector<int8_t>> qs(count, p.qs);
  std::vector<std::vector<float>> scales(count, p.scales);
  for (auto _ : state) {
    for (int64_t i = 0; i < count; ++i) {
      Q8Matrix m{qs[i].data(), scales[i].data(), n, k};
      GemmQ8(p.x.data(), k, m, nullptr, p.y.data(), n, 1, false);
    }
    benchmark::DoNotOptimize(p.y.data());
  }
  SetBytes(state, count * (n * k + n * k / kQ8Block * 4));
}
BENCHMARK(BM_GemvQ8Sequence);

// A prefill chunk: 256 rows of activations times the weights, invariant kernels against the
// widen-and-OpenBLAS path (arg 2: 0 f32, 1 bf16, 2 q8; arg 3: 1 = batch-invariant kernels).
void BM_Prefill(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  const int64_t m = 256;
  std::vector<float> x(m * p.k), y(m * p.n);
  for (size_t i = 0; i < x.size(); ++i) x[i] = p.x[i % p.k] * (1.0f + i % 7);
  const Q8Matrix q8{p.qs.data(), p.scales.data(), p.n, p.k};
  const bool rows = state.range(3) == 1;
  for (auto _ : state) {
    switch (state.range(2)) {
      case 0:
        rows ? GemmRowsF32(x.data(), p.k, p.w.data(), p.k, nullptr, y.data(), p.n, m, p.n, p.k,
                           false)
             : Gemm(x.data(), p.k, p.w.data(), p.k, nullptr, y.data(), p.n, m, p.n, p.k, false);
        break;
      case 1:
        rows ? GemmRowsBf16(x.data(), p.k, p.w_bf16.data(), nullptr, y.data(), p.n, m, p.n, p.k,
                            false)
             : GemmBf16(x.data(), p.k, p.w_bf16.data(), nullptr, y.data(), p.n, m, p.n, p.k, false);
        break;
      default:
        rows ? GemmRowsQ8(x.data(), p.k, q8, nullptr, y.data(), p.n, m, false)
             : GemmQ8(x.data(), p.k, q8, nullptr, y.data(), p.n, m, false);
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * m * p.n * p.k * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Prefill)->ArgsProduct({{3072}, {576}, {0, 1, 2}, {0, 1}});

// A prefill chunk of 256 rows on the block formats' integer-dot kernels (arg 2: 0 Q4_1, 1 Q5_1,
// 2 Q8): what a GGUF file's matrices cost a prompt (SmolLM2's gate+up and down shapes).
void BM_PrefillBlocks(benchmark::State& state) {
  Problem p(state.range(0), state.range(1));
  const int64_t m = 256;
  std::vector<float> x(m * p.k), y(m * p.n);
  for (size_t i = 0; i < x.size(); ++i) x[i] = p.x[i % p.k] * (1.0f + i % 7);
  const Q4_1Matrix q4{p.q4_qs.data(), p.q4_d.data(), p.q4_m.data(), p.n, p.k};
  const Q5_1Matrix q5{p.q5_qs.data(), p.q5_qh.data(), p.q5_d.data(), p.q5_m.data(), p.n, p.k};
  const Q8Matrix q8{p.qs.data(), p.scales.data(), p.n, p.k};
  for (auto _ : state) {
    switch (state.range(2)) {
      case 0:
        GemmRowsQ4_1(x.data(), p.k, q4, nullptr, y.data(), p.n, m, false);
        break;
      case 1:
        GemmRowsQ5_1(x.data(), p.k, q5, nullptr, y.data(), p.n, m, false);
        break;
      default:
        GemmRowsQ8(x.data(), p.k, q8, nullptr, y.data(), p.n, m, false);
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * m * p.n * p.k * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PrefillBlocks)->ArgsProduct({{3072}, {576}, {0, 1, 2}})->Args({576, 1536, 1});

// SmolLM2-135M: fused gate+up [3072, 576], down [576, 1536], lm_head [49152, 576];
// Llama-3.2-1B: gate+up [16384, 2048].
// The last shape (113 MB in Q8) cannot stay in any cache: it streams from DRAM as decode does.
#define SHAPES              \
  ->Args({3072, 576})       \
      ->Args({576, 1536})   \
      ->Args({49152, 576})  \
      ->Args({16384, 2048}) \
      ->Args({196608, 576})
BENCHMARK(BM_GemvF32) SHAPES;
BENCHMARK(BM_GemvBf16) SHAPES;
BENCHMARK(BM_GemvRowsF32) SHAPES;
BENCHMARK(BM_GemvRowsBf16) SHAPES;
BENCHMARK(BM_GemvRowsQ8) SHAPES;
BENCHMARK(BM_GemvRowsQ4_1) SHAPES;
BENCHMARK(BM_GemvRowsQ5_1) SHAPES;
// Q6_K rows are whole super-blocks of 256: SmolLM2's down projection, and the large shapes' bytes.
BENCHMARK(BM_GemvRowsQ6_K)->Args({576, 1536})->Args({16384, 2048})->Args({73728, 1536});
BENCHMARK(BM_GemvRowsQ8)->Args({73728, 1536});
BENCHMARK(BM_GemvQ8) SHAPES;
BENCHMARK(BM_ReadBandwidth) SHAPES;

}  // namespace
}  // namespace infinigen::cpu

BENCHMARK_MAIN();
