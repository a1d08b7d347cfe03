// Every CPU reference kernel against a straightforward double-precision loop, on odd sizes,
// strided inputs and fresh random data.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <memory>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/ops.h"

namespace infinigen::cpu {
namespace {

std::vector<float> Random(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void ExpectNear(const std::vector<double>& want, const float* got, size_t n, double tol,
                const char* what) {
  for (size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(want[i], got[i], tol * (1.0 + std::abs(want[i]))) << what << " at " << i;
  }
}

TEST(CpuKernels, RmsNormMatchesDoubleLoop) {
  std::mt19937 rng(1);
  const int64_t rows = 5, cols = 37, stride = 41;
  auto x = Random(rows * stride, rng, 3.0f);
  auto w = Random(cols, rng);
  std::vector<float> out(rows * cols);
  RmsNorm(x.data(), stride, w.data(), rows, cols, 1e-5f, out.data(), cols);
  std::vector<double> want(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < cols; ++i) ss += double(x[r * stride + i]) * x[r * stride + i];
    const double inv = 1.0 / std::sqrt(ss / cols + 1e-5);
    for (int64_t i = 0; i < cols; ++i) want[r * cols + i] = w[i] * x[r * stride + i] * inv;
  }
  ExpectNear(want, out.data(), want.size(), 1e-5, "rmsnorm");
}

TEST(CpuKernels, LayerNormMatchesDoubleLoopInPlace) {
  std::mt19937 rng(2);
  const int64_t rows = 3, cols = 29;
  auto x = Random(rows * cols, rng, 2.0f);
  for (float& v : x) v += 5.0f;  // a large mean tests the centring
  auto w = Random(cols, rng), b = Random(cols, rng);
  std::vector<double> want(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < cols; ++i) mean += x[r * cols + i];
    mean /= cols;
    for (int64_t i = 0; i < cols; ++i) var += (x[r * cols + i] - mean) * (x[r * cols + i] - mean);
    var /= cols;
    for (int64_t i = 0; i < cols; ++i) {
      want[r * cols + i] = (x[r * cols + i] - mean) / std::sqrt(var + 1e-5) * w[i] + b[i];
    }
  }
  LayerNorm(x.data(), cols, w.data(), b.data(), rows, cols, 1e-5f, x.data(), cols);
  ExpectNear(want, x.data(), want.size(), 1e-5, "layernorm");
}

void CheckGemm(int64_t m, int64_t n, int64_t k, bool bias, bool accumulate) {
  std::mt19937 rng(static_cast<unsigned>(m * 100 + n + k));
  const int64_t ldx = k + 3, ldw = k + 1, ldy = n + 2;
  auto x = Random(m * ldx, rng), w = Random(n * ldw, rng), b = Random(n, rng);
  auto y = Random(m * ldy, rng);
  std::vector<double> want(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = bias ? b[j] : 0.0;
      for (int64_t p = 0; p < k; ++p) s += double(x[i * ldx + p]) * w[j * ldw + p];
      if (accumulate) s += y[i * ldy + j];
      want[i * n + j] = s;
    }
  }
  Gemm(x.data(), ldx, w.data(), ldw, bias ? b.data() : nullptr, y.data(), ldy, m, n, k, accumulate);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_NEAR(want[i * n + j], y[i * ldy + j], 1e-4 * (1 + std::abs(want[i * n + j])))
          << "m=" << m << " i=" << i << " j=" << j;
    }
  }
}

TEST(CpuKernels, GemmMatchesDoubleLoop) {
  for (bool bias : {false, true}) {
    for (bool acc : {false, true}) {
      CheckGemm(1, 13, 29, bias, acc);  // the GEMV path
      CheckGemm(7, 13, 29, bias, acc);
    }
  }
}

TEST(CpuKernels, RopeBothLayoutsMatchDoubleLoop) {
  std::mt19937 rng(3);
  const int rows = 4, heads = 3, head_dim = 10, rotary = 8;
  const int64_t stride = heads * head_dim + 2;
  std::vector<int32_t> pos = {0, 5, 17, 1023};
  auto inv = Random(rotary / 2, rng, 0.5f);
  for (auto layout : {RopeLayout::kHalf, RopeLayout::kInterleaved}) {
    auto x = Random(rows * stride, rng);
    std::vector<double> want(x.begin(), x.end());
    for (int r = 0; r < rows; ++r) {
      for (int h = 0; h < heads; ++h) {
        for (int i = 0; i < rotary / 2; ++i) {
          const int64_t base = r * stride + h * head_dim;
          const int64_t a = layout == RopeLayout::kHalf ? base + i : base + 2 * i;
          const int64_t b = layout == RopeLayout::kHalf ? base + i + rotary / 2 : base + 2 * i + 1;
          const double th = double(pos[r]) * inv[i];
          want[a] = x[a] * std::cos(th) - x[b] * std::sin(th);
          want[b] = x[b] * std::cos(th) + x[a] * std::sin(th);
        }
      }
    }
    Rope(x.data(), stride, rows, heads, head_dim, rotary, pos.data(), inv.data(), layout);
    // float32 angles at position 1023 carry ~1e-4 absolute error, as in Hugging Face.
    ExpectNear(want, x.data(), want.size(), 5e-4, "rope");
  }
}

TEST(CpuKernels, ElementwiseOpsMatchDoubleLoops) {
  std::mt19937 rng(4);
  const int64_t rows = 3, cols = 11;
  auto g = Random(rows * cols, rng, 3.0f), u = Random(rows * cols, rng);
  // Gates far out on both sides (exp's clamps; SwiGlu's vector lanes and its tail).
  const float far[] = {-120.0f, -88.5f, -87.0f, 87.5f, 89.0f, 120.0f};
  for (size_t i = 0; i < std::size(far); ++i) g[5 * i + 1] = far[i];
  std::vector<float> out(rows * cols);
  SwiGlu(g.data(), cols, u.data(), cols, rows, cols, out.data(), cols);
  std::vector<double> want(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) want[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
  ExpectNear(want, out.data(), want.size(), 1e-5, "swiglu");

  auto r = g;
  Relu(r.data(), cols, rows, cols);
  for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(r[i], g[i] > 0 ? g[i] : 0.0f);

  auto y = u;
  Add(g.data(), cols, rows, cols, y.data(), cols);
  for (int64_t i = 0; i < rows * cols; ++i) ASSERT_FLOAT_EQ(y[i], u[i] + g[i]);

  auto s = Random(17, rng, 10.0f);
  std::vector<double> ws(17);
  double mx = -1e30, sum = 0;
  for (float v : s) mx = std::max(mx, double(v));
  for (int i = 0; i < 17; ++i) sum += std::exp(s[i] - mx);
  for (int i = 0; i < 17; ++i) ws[i] = std::exp(s[i] - mx) / sum;
  Softmax(s.data(), 17);
  ExpectNear(ws, s.data(), 17, 1e-6, "softmax");

  const int64_t dim = 6;
  auto table = Random(9 * dim, rng);
  std::vector<int32_t> ids = {8, 0, 3};
  std::vector<float> e(3 * dim);
  Embedding(table.data(), dim, ids.data(), 3, e.data(), dim);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < dim; ++j) ASSERT_EQ(e[i * dim + j], table[ids[i] * dim + j]);
  }
}

// Double-precision attention of one query row over listed rows of its KV head.
std::vector<double> RefAttendRow(const float* q, const std::vector<float>& k,
                                 const std::vector<float>& v, int64_t head_stride,
                                 int64_t row_stride, const std::vector<int32_t>& rows_of_head,
                                 int g, int d, double scale) {
  std::vector<double> s(rows_of_head.size());
  double mx = -1e300;
  for (size_t j = 0; j < rows_of_head.size(); ++j) {
    double dot = 0;
    for (int c = 0; c < d; ++c)
      dot += double(q[c]) * k[g * head_stride + rows_of_head[j] * row_stride + c];
    s[j] = dot * scale;
    mx = std::max(mx, s[j]);
  }
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - mx));
  std::vector<double> out(d, 0.0);
  for (size_t j = 0; j < rows_of_head.size(); ++j) {
    for (int c = 0; c < d; ++c)
      out[c] += s[j] / sum * v[g * head_stride + rows_of_head[j] * row_stride + c];
  }
  return out;
}

TEST(CpuKernels, CausalAttentionWithGqaMatchesDoubleLoop) {
  std::mt19937 rng(5);
  const int heads = 6, kv_heads = 3, d = 13;
  const int64_t ctx_cap = 300, row_stride = d + 3, head_stride = ctx_cap * row_stride;
  for (int64_t q_start : {0, 37}) {
    const int64_t num_q = 150;  // more than one query block
    auto k = Random(kv_heads * head_stride, rng), v = Random(kv_heads * head_stride, rng);
    const int64_t q_stride = heads * d + 1;
    auto q = Random(num_q * q_stride, rng, 2.0f);
    std::vector<float> out(num_q * heads * d);
    const float scale = 1.0f / std::sqrt(float(d));
    AttentionCausal(q.data(), q_stride, num_q, q_start, {k.data(), head_stride, row_stride},
                    {v.data(), head_stride, row_stride}, heads, kv_heads, d, scale, out.data(),
                    heads * d);
    for (int64_t i = 0; i < num_q; i += 7) {
      std::vector<int32_t> visible(q_start + i + 1);
      for (size_t j = 0; j < visible.size(); ++j) visible[j] = static_cast<int32_t>(j);
      for (int h = 0; h < heads; ++h) {
        auto want = RefAttendRow(q.data() + i * q_stride + h * d, k, v, head_stride, row_stride,
                                 visible, h / (heads / kv_heads), d, scale);
        for (int c = 0; c < d; ++c) {
          ASSERT_NEAR(want[c], out[i * heads * d + h * d + c], 1e-5)
              << "q_start=" << q_start << " row " << i << " head " << h;
        }
      }
    }
  }
}

// The batch-invariant prefill attention: every query row of a block, whatever q_start and the
// block's size, is bit for bit what AttentionDecode gives that row over the rows it sees (so a
// prompt's last token equals a decode step of it, and chunking a prompt changes nothing).
TEST(CpuKernels, CausalRowsEqualDecodeOfEachRowBitForBit) {
  std::mt19937 rng(9);
  const int heads = 9, kv_heads = 3, d = 64;
  const int64_t cap = 700, row_stride = d, head_stride = cap * row_stride;
  auto k = Random(kv_heads * head_stride, rng), v = Random(kv_heads * head_stride, rng);
  for (const auto& [q_start, num_q] :
       {std::pair<int64_t, int64_t>{0, 1}, {0, 5}, {0, 40}, {3, 1}, {250, 20}, {600, 37}}) {
    const int64_t q_stride = heads * d;
    auto q = Random(num_q * q_stride, rng, 2.0f);
    std::vector<float> out(num_q * heads * d), want(heads * d);
    const float scale = 0.125f;
    AttentionCausalRows(q.data(), q_stride, num_q, q_start, {k.data(), head_stride, row_stride},
                        {v.data(), head_stride, row_stride}, heads, kv_heads, d, scale, out.data(),
                        heads * d);
    for (int64_t i = 0; i < num_q; ++i) {
      AttentionDecode(q.data() + i * q_stride, {k.data(), head_stride, row_stride},
                      {v.data(), head_stride, row_stride}, nullptr, q_start + i + 1, heads,
                      kv_heads, d, scale, want.data());
      for (int c = 0; c < heads * d; ++c) {
        ASSERT_EQ(out[i * heads * d + c], want[c])
            << "q_start " << q_start << ", row " << i << ", value " << c;
      }
    }
  }
}

// The attention of prefill rows (and so of decode, which computes each row alike) gives the same
// bits with the AVX-512 kernels as with the AVX2 ones.
TEST(CpuKernels, AttentionIsTheSameOnEveryIsa) {
  if (!CpuHasAvx512()) GTEST_SKIP() << "this CPU has no AVX-512: only the AVX2 kernels run here";
  CapIsaForTesting(Isa::kAvx512);
  if (ActiveIsa() != Isa::kAvx512) GTEST_SKIP() << "INFINIGEN_CPU_ISA=avx2 caps this run";
  std::mt19937 rng(11);
  const int heads = 9, kv_heads = 3, d = 64;
  const int64_t cap = 700, row_stride = d, head_stride = cap * row_stride, num_q = 37;
  const int64_t q_start = 600, q_stride = heads * d;
  auto k = Random(kv_heads * head_stride, rng), v = Random(kv_heads * head_stride, rng);
  auto q = Random(num_q * q_stride, rng, 2.0f);
  std::vector<float> out[2];
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    CapIsaForTesting(isa);
    auto& o = out[isa == Isa::kAvx512];
    o.resize(num_q * heads * d);
    AttentionCausalRows(q.data(), q_stride, num_q, q_start, {k.data(), head_stride, row_stride},
                        {v.data(), head_stride, row_stride}, heads, kv_heads, d, 0.125f, o.data(),
                        heads * d);
  }
  EXPECT_EQ(out[0], out[1]);
}

// The counter-hash fill behind random benchmark weights: in range, the same for the same seed,
// and any slice (`first`) of a tensor equals the same elements of the whole.
TEST(CpuKernels, FillRandomIsACounterHash) {
  std::vector<float> a(1000), b(1000), slice(100);
  FillRandom(a.data(), 1000, 7, 0.5f);
  FillRandom(b.data(), 1000, 7, 0.5f);
  FillRandom(slice.data(), 100, 7, 0.5f, 450);
  EXPECT_EQ(a, b);
  EXPECT_TRUE(std::equal(slice.begin(), slice.end(), a.begin() + 450));
  double mean = 0;
  for (float v : a) {
    ASSERT_GE(v, -0.5f);
    ASSERT_LT(v, 0.5f);
    mean += v / 1000;
  }
  EXPECT_NEAR(mean, 0.0, 0.05);
  FillRandom(b.data(), 1000, 8, 0.5f);
  EXPECT_NE(a, b);
}

// K and V of `cap` rows per KV head, one query, and num_rows random row indices per KV head
// (repeats allowed).
struct DecodeCase {
  int heads, kv_heads, d;
  int64_t num_rows, row_stride, head_stride;
  std::vector<float> k, v, q;
  std::vector<int32_t> idx;

  DecodeCase(unsigned seed, int heads, int kv_heads, int d, int64_t cap, int64_t num_rows)
      : heads(heads),
        kv_heads(kv_heads),
        d(d),
        num_rows(num_rows),
        row_stride(d),
        head_stride(cap * d),
        idx(kv_heads * num_rows) {
    std::mt19937 rng(seed);
    k = Random(kv_heads * head_stride, rng);
    v = Random(kv_heads * head_stride, rng);
    q = Random(heads * d, rng, 2.0f);
    for (auto& i : idx) i = static_cast<int32_t>(rng() % cap);
  }
};

// 9 rows: one task per KV head; 700 rows: several chunks per KV head, merged (the last one
// partial). The output and the attention probabilities against a double loop.
TEST(CpuKernels, DecodeAttentionOverIndexListMatchesDoubleLoop) {
  for (int64_t num_rows : {9, 700}) {
    DecodeCase c(6, 8, 2, 12, 1000, num_rows);
    const float scale = 0.3f;
    for (bool with_indices : {true, false}) {
      std::vector<float> out(c.heads * c.d), weights(c.heads * c.num_rows);
      AttentionDecode(c.q.data(), {c.k.data(), c.head_stride, c.row_stride},
                      {c.v.data(), c.head_stride, c.row_stride},
                      with_indices ? c.idx.data() : nullptr, c.num_rows, c.heads, c.kv_heads, c.d,
                      scale, out.data(), weights.data());
      for (int h = 0; h < c.heads; ++h) {
        const int g = h / (c.heads / c.kv_heads);
        std::vector<int32_t> rows(c.num_rows);
        for (int64_t j = 0; j < c.num_rows; ++j) {
          rows[j] = with_indices ? c.idx[g * c.num_rows + j] : static_cast<int32_t>(j);
        }
        auto want = RefAttendRow(c.q.data() + h * c.d, c.k, c.v, c.head_stride, c.row_stride, rows,
                                 g, c.d, scale);
        for (int e = 0; e < c.d; ++e) {
          ASSERT_NEAR(want[e], out[h * c.d + e], 1e-5) << num_rows << " rows, head " << h;
        }
        std::vector<double> p(c.num_rows);
        double max_s = -INFINITY, sum = 0;
        for (int64_t j = 0; j < c.num_rows; ++j) {
          const float* kr = c.k.data() + g * c.head_stride + rows[j] * c.row_stride;
          double dot = 0;
          for (int e = 0; e < c.d; ++e) dot += double(c.q[h * c.d + e]) * kr[e];
          p[j] = dot * scale;
          max_s = std::max(max_s, p[j]);
        }
        for (double& x : p) sum += (x = std::exp(x - max_s));
        for (int64_t j = 0; j < c.num_rows; ++j) {
          ASSERT_NEAR(p[j] / sum, weights[h * c.num_rows + j], 1e-6)
              << num_rows << " rows, head " << h << " row " << j;
        }
      }
    }
  }
}

TEST(CpuKernels, DecodeAttentionOverRowTablesEqualsPackedRowsBitForBit) {
  // The same rows given by address (in place, e.g. in the KV store's arena) and packed by
  // index: the same sums in the same order.
  DecodeCase c(7, 6, 3, 16, 40, 11);
  std::vector<const void*> k_rows(c.idx.size()), v_rows(c.idx.size());
  for (int g = 0; g < c.kv_heads; ++g) {
    for (int64_t j = 0; j < c.num_rows; ++j) {
      const int64_t at = g * c.head_stride + c.idx[g * c.num_rows + j] * c.row_stride;
      k_rows[g * c.num_rows + j] = c.k.data() + at;
      v_rows[g * c.num_rows + j] = c.v.data() + at;
    }
  }
  std::vector<float> packed(c.heads * c.d), table(c.heads * c.d), w_packed(c.heads * c.num_rows),
      w_table(c.heads * c.num_rows);
  AttentionDecode(c.q.data(), {c.k.data(), c.head_stride, c.row_stride},
                  {c.v.data(), c.head_stride, c.row_stride}, c.idx.data(), c.num_rows, c.heads,
                  c.kv_heads, c.d, 0.25f, packed.data(), w_packed.data());
  // Row tables with an index list over them (the worker's prefetched map), here the identity.
  std::vector<int32_t> identity(c.idx.size());
  for (int g = 0; g < c.kv_heads; ++g) {
    for (int64_t j = 0; j < c.num_rows; ++j) identity[g * c.num_rows + j] = static_cast<int32_t>(j);
  }
  AttentionDecode(c.q.data(), {nullptr, c.num_rows, 1, k_rows.data()},
                  {nullptr, c.num_rows, 1, v_rows.data()}, identity.data(), c.num_rows, c.heads,
                  c.kv_heads, c.d, 0.25f, table.data(), w_table.data());
  EXPECT_EQ(table, packed);
  EXPECT_EQ(w_table, w_packed);
  std::fill(table.begin(), table.end(), 0.0f);
  AttentionDecode(c.q.data(), {nullptr, c.num_rows, 1, k_rows.data()},
                  {nullptr, c.num_rows, 1, v_rows.data()}, nullptr, c.num_rows, c.heads, c.kv_heads,
                  c.d, 0.25f, table.data());
  EXPECT_EQ(table, packed);
}

// A batch of decode queries (AttentionDecodeBatch: their tasks shared out together) gives each
// query, bit for bit, what AttentionDecode of it alone gives: contexts of 0 to 2000 rows (one
// task, chunks merged, a partial last chunk), by index list, packed and by row table, float32 and
// bfloat16 K/V in one batch, on the team and (small batches) on the caller.
TEST(CpuKernels, DecodeAttentionOfABatchEqualsEachQueryAloneBitForBit) {
  const int heads = 6, kv_heads = 3, d = 13;
  const float scale = 0.3f;
  for (const std::vector<int64_t>& rows :
       {std::vector<int64_t>{9, 2}, std::vector<int64_t>{700, 0, 1, 256, 257, 2000, 40, 511}}) {
    std::vector<std::unique_ptr<DecodeCase>> cases;
    std::vector<std::vector<uint16_t>> kb(rows.size()), vb(rows.size());
    std::vector<std::vector<const void*>> k_rows(rows.size()), v_rows(rows.size());
    std::vector<DecodeQuery> queries;
    std::vector<std::vector<float>> batch_out(rows.size()), alone(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      cases.push_back(std::make_unique<DecodeCase>(40 + i, heads, kv_heads, d, 2048, rows[i]));
      const DecodeCase& c = *cases.back();
      KvRows k{c.k.data(), c.head_stride, c.row_stride}, v{c.v.data(), c.head_stride, c.row_stride};
      const int32_t* indices = c.idx.data();
      if (i % 4 == 1) {  // bfloat16
        kb[i].resize(c.k.size());
        vb[i].resize(c.v.size());
        for (size_t e = 0; e < c.k.size(); ++e) kb[i][e] = FloatToBf16(c.k[e]);
        for (size_t e = 0; e < c.v.size(); ++e) vb[i][e] = FloatToBf16(c.v[e]);
        k = {kb[i].data(), c.head_stride, c.row_stride, nullptr, true};
        v = {vb[i].data(), c.head_stride, c.row_stride, nullptr, true};
      } else if (i % 4 == 2) {  // packed rows 0 .. num_rows - 1
        indices = nullptr;
      } else if (i % 4 == 3) {  // row tables (the store's rows in place), no index list
        for (int g = 0; g < kv_heads; ++g) {
          for (int64_t j = 0; j < c.num_rows; ++j) {
            const int64_t at = g * c.head_stride + c.idx[g * c.num_rows + j] * c.row_stride;
            k_rows[i].push_back(c.k.data() + at);
            v_rows[i].push_back(c.v.data() + at);
          }
        }
        k = {nullptr, c.num_rows, 1, k_rows[i].data()};
        v = {nullptr, c.num_rows, 1, v_rows[i].data()};
        indices = nullptr;
      }
      batch_out[i].assign(heads * d, -1.0f);
      alone[i].assign(heads * d, -2.0f);
      queries.push_back({c.q.data(), k, v, indices, c.num_rows, batch_out[i].data()});
      AttentionDecode(c.q.data(), k, v, indices, c.num_rows, heads, kv_heads, d, scale,
                      alone[i].data());
    }
    AttentionDecodeBatch(queries, heads, kv_heads, d, scale);
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(batch_out[i], alone[i])
          << "query " << i << " of " << rows.size() << ", " << rows[i] << " rows";
    }
  }
}

// bfloat16 K/V are read widened exactly to float32: attention over bf16 rows equals, bit for bit,
// attention over float32 rows holding the same (rounded) values, for decode over an index list,
// over row tables, and for the per-row prefill (head sizes with and without vector tails).
TEST(CpuKernels, Bf16KvEqualsFloatKvOfTheSameValuesBitForBit) {
  std::mt19937 rng(21);
  for (int d : {64, 13, 40}) {
    const int heads = 6, kv_heads = 2;
    const int64_t cap = 600, row_stride = d, head_stride = cap * row_stride;
    auto k = Random(kv_heads * head_stride, rng), v = Random(kv_heads * head_stride, rng);
    std::vector<uint16_t> kb(k.size()), vb(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      kb[i] = FloatToBf16(k[i]);
      vb[i] = FloatToBf16(v[i]);
      k[i] = Bf16ToFloat(kb[i]);
      v[i] = Bf16ToFloat(vb[i]);
    }
    const KvRows kf{k.data(), head_stride, row_stride}, vf{v.data(), head_stride, row_stride};
    const KvRows kh{kb.data(), head_stride, row_stride, nullptr, true},
        vh{vb.data(), head_stride, row_stride, nullptr, true};
    const float scale = 1.0f / std::sqrt(float(d));
    // Decode over a scattered index list of 300 rows per KV head (two chunks).
    const int64_t n = 300;
    std::vector<int32_t> idx(kv_heads * n);
    for (auto& i : idx) i = static_cast<int32_t>(rng() % cap);
    auto q = Random(heads * d, rng, 2.0f);
    std::vector<float> a(heads * d), b(heads * d), wa(heads * n), wb(heads * n);
    AttentionDecode(q.data(), kf, vf, idx.data(), n, heads, kv_heads, d, scale, a.data(),
                    wa.data());
    AttentionDecode(q.data(), kh, vh, idx.data(), n, heads, kv_heads, d, scale, b.data(),
                    wb.data());
    EXPECT_EQ(a, b) << "decode, head_dim " << d;
    EXPECT_EQ(wa, wb) << "decode weights, head_dim " << d;
    // The same rows through row tables of bf16 rows.
    std::vector<const void*> k_rows(idx.size()), v_rows(idx.size());
    for (int g = 0; g < kv_heads; ++g) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = g * head_stride + idx[g * n + j] * row_stride;
        k_rows[g * n + j] = kb.data() + at;
        v_rows[g * n + j] = vb.data() + at;
      }
    }
    std::fill(b.begin(), b.end(), 0.0f);
    AttentionDecode(q.data(), {nullptr, n, 1, k_rows.data(), true},
                    {nullptr, n, 1, v_rows.data(), true}, nullptr, n, heads, kv_heads, d, scale,
                    b.data());
    EXPECT_EQ(a, b) << "row tables, head_dim " << d;
    // Prefill rows 500..539 over the first 540 rows.
    const int64_t num_q = 40, q_start = 500, q_stride = heads * d;
    auto qs = Random(num_q * q_stride, rng, 2.0f);
    std::vector<float> pa(num_q * q_stride), pb(num_q * q_stride);
    AttentionCausalRows(qs.data(), q_stride, num_q, q_start, kf, vf, heads, kv_heads, d, scale,
                        pa.data(), q_stride);
    AttentionCausalRows(qs.data(), q_stride, num_q, q_start, kh, vh, heads, kv_heads, d, scale,
                        pb.data(), q_stride);
    EXPECT_EQ(pa, pb) << "prefill, head_dim " << d;
  }
}

}  // namespace
}  // namespace infinigen::cpu
