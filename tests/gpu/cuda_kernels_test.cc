// The InfiniGen pieces of kernels/cuda against their CPU references: batched decode attention
// with the current token, speculation (scores, budget, group mass, top-k), top-k ties, the gather
// from host-mapped memory, the scatter of new rows, argmax and sampling. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gpu_worker/infinigen/selection_util.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace infinigen {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(expr)

// Device memory freed at scope exit.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)),
              cudaSuccess);
  }
  explicit Dev(const std::vector<T>& v) : Dev(v.size()) {
    EXPECT_EQ(cudaMemcpy(p, v.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  std::vector<T> Get() const {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    const unsigned seed = std::random_device{}();
    rng_.seed(seed);
    RecordProperty("seed", std::to_string(seed));  // to replay a failure: seed rng_ with it
    std::fprintf(stderr, "seed %u\n", seed);
  }
  std::vector<float> Random(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  // bf16 bits of v, and v rounded to bf16.
  static std::vector<uint16_t> Bf16(std::vector<float>& v) {
    std::vector<uint16_t> h(v.size());
    ConvertFromFloat(v.data(), DType::kBF16, h.data(), v.size());
    ConvertToFloat(DType::kBF16, h.data(), v.data(), v.size());
    return h;
  }
  // cuda::TopK's rows of each of kv_heads runs of n scores, and the host's (TopK, head after
  // head).
  static std::vector<int32_t> DeviceTopK(const std::vector<float>& s, int kv_heads, int64_t n,
                                         int64_t k) {
    Dev<float> ds(s);
    Dev<int32_t> out(kv_heads * k);
    EXPECT_EQ(cuda::TopK(ds.p, kv_heads, n, k, out.p, nullptr), cudaSuccess);
    return out.Get();
  }
  static std::vector<int32_t> HostTopK(const std::vector<float>& s, int kv_heads, int64_t n,
                                       int64_t k) {
    std::vector<int32_t> want;
    for (int g = 0; g < kv_heads; ++g) TopK(&s[g * n], n, k, {}, want);
    return want;
  }
  std::mt19937 rng_;
};

// Admission sets DecodeAttentionWorkspaceBound aside for the decode attention of a batch
// (CudaBackend::DecodeScratchBytes): no launch of that many sequences asks for more, over one
// split for all or each sequence's own. Host arithmetic only: it runs without a GPU.
TEST(CudaDecodeWorkspace, NoLaunchOfABatchNeedsMoreThanItsBound) {
  const cuda::DecodeSeq fake{};
  for (int kv : {1, 2, 3, 8, 32}) {
    for (int group : {1, 3, 4, 8}) {
      for (int hd : {64, 80, 128}) {
        for (int batch : {1, 2, 7, 16, 64}) {
          const size_t bound = cuda::DecodeAttentionWorkspaceBound(batch, kv * group, kv, hd);
          cuda::DecodeAttention a;
          a.batch = batch;
          a.num_heads = kv * group;
          a.num_kv_heads = kv;
          a.head_dim = hd;
          int32_t most = 0;
          for (int32_t rows : {0, 1, 63, 64, 65, 1000, 32768, 1 << 20}) {
            SCOPED_TRACE(absl::StrCat(kv, " kv heads, group ", group, ", ", hd, " dims, batch ",
                                      batch, ", ", rows, " rows"));
            a.seqs = nullptr;
            a.num_rows = rows;
            a.k_cur = nullptr;
            EXPECT_LE(cuda::DecodeAttentionWorkspaceBytes(a), bound);
            a.k_cur = &fake;  // one row more
            EXPECT_LE(cuda::DecodeAttentionWorkspaceBytes(a), bound);
            a.k_cur = nullptr;
            int32_t splits = 0, per = 0;
            cuda::DecodeSplitFor(kv, rows, &splits, &per);
            most = std::max(most, splits);
            a.seqs = &fake;  // each sequence its own split, the launch the most of one
            a.max_splits = most;
            EXPECT_LE(cuda::DecodeAttentionWorkspaceBytes(a), bound);
          }
        }
      }
    }
  }
}

// Random weights of benchmark models are made on the device; the host recomputes them (the
// speculation's W_q rows of a random model): the same values, f32 exactly, bf16 as rounded.
TEST_F(CudaKernels, FillRandomEqualsTheCpuReference) {
  const int64_t n = 100003;
  std::vector<float> want(n);
  cpu::FillRandom(want.data(), n, 12345, 0.25f);
  Dev<float> f32(n);
  ASSERT_EQ(cuda::FillRandom(f32.p, cuda::Elem::kF32, n, 12345, 0.25f, nullptr), cudaSuccess);
  EXPECT_EQ(f32.Get(), want);
  Dev<uint16_t> bf16(n);
  ASSERT_EQ(cuda::FillRandom(bf16.p, cuda::Elem::kBF16, n, 12345, 0.25f, nullptr), cudaSuccess);
  std::vector<float> rounded = want;
  EXPECT_EQ(bf16.Get(), Bf16(rounded));
}

TEST_F(CudaKernels, BatchedDecodeWithCurrentTokenMatchesReference) {
  const int batch = 3, heads = 8, kv_heads = 2, hd = 24;
  const int64_t cap = 300, rows = 70;
  auto k = Random(batch * kv_heads * cap * hd), v = Random(batch * kv_heads * cap * hd);
  auto q = Random(batch * heads * hd, 2.0f), kc = Random(batch * kv_heads * hd),
       vc = Random(batch * kv_heads * hd);
  std::vector<int32_t> counts = {70, 1, 33}, idx(batch * kv_heads * rows);
  for (auto& i : idx) i = static_cast<int32_t>(rng_() % cap);
  Dev<float> dk(k), dv(v), dq(q), dkc(kc), dvc(vc), out(batch * heads * hd);
  Dev<int32_t> didx(idx), dcounts(counts);
  cuda::DecodeAttention a;
  a.type = cuda::Elem::kF32;
  a.batch = batch, a.num_heads = heads, a.num_kv_heads = kv_heads, a.head_dim = hd;
  a.scale = 0.2f;
  a.q = dq.p, a.q_seq_stride = heads * hd;
  a.k = dk.p, a.v = dv.p, a.kv_seq_stride = kv_heads * cap * hd, a.head_stride = cap * hd;
  a.row_stride = hd;
  a.indices = didx.p, a.index_seq_stride = kv_heads * rows, a.index_head_stride = rows;
  a.num_rows_per_seq = dcounts.p, a.max_rows = rows;
  a.k_cur = dkc.p, a.v_cur = dvc.p, a.cur_seq_stride = kv_heads * hd;
  a.out = out.p, a.out_seq_stride = heads * hd;
  Dev<uint8_t> ws(cuda::DecodeAttentionWorkspaceBytes(a));
  a.workspace = ws.p;
  CUDA_OK(cuda::RunDecodeAttention(a, nullptr));
  const auto got = out.Get();
  for (int b = 0; b < batch; ++b) {
    // Reference: the listed rows then the current token, as one KV matrix per head.
    const int64_t n = counts[b] + 1;
    std::vector<float> rk(kv_heads * n * hd), rv(kv_heads * n * hd), want(heads * hd);
    for (int g = 0; g < kv_heads; ++g) {
      for (int64_t j = 0; j < n; ++j) {
        const float* sk =
            j < counts[b] ? &k[((b * kv_heads + g) * cap + idx[(b * kv_heads + g) * rows + j]) * hd]
                          : &kc[(b * kv_heads + g) * hd];
        const float* sv =
            j < counts[b] ? &v[((b * kv_heads + g) * cap + idx[(b * kv_heads + g) * rows + j]) * hd]
                          : &vc[(b * kv_heads + g) * hd];
        std::copy_n(sk, hd, &rk[(g * n + j) * hd]);
        std::copy_n(sv, hd, &rv[(g * n + j) * hd]);
      }
    }
    cpu::AttentionDecode(&q[b * heads * hd], {rk.data(), n * hd, hd}, {rv.data(), n * hd, hd},
                         nullptr, n, heads, kv_heads, hd, 0.2f, want.data());
    for (int i = 0; i < heads * hd; ++i) {
      ASSERT_NEAR(got[b * heads * hd + i], want[i], 2e-5f) << "sequence " << b << " at " << i;
    }
  }
}

TEST_F(CudaKernels, TopKMatchesTheHostSelectionWithTies) {
  const int kv_heads = 3;
  for (int64_t n : {1, 17, 1000, 40000}) {
    std::vector<float> s(kv_heads * n);
    for (auto& x : s) x = static_cast<float>(static_cast<int>(rng_() % 50)) - 20.0f;  // many ties
    for (int64_t k : {int64_t{1}, n / 3 + 1, n}) {
      EXPECT_EQ(DeviceTopK(s, kv_heads, n, k), HostTopK(s, kv_heads, n, k))
          << "n " << n << " k " << k;
    }
  }
}

// NaN ranks lowest and -0 ties with +0 on both sides: a NaN mass must not outrank the FLT_MAX
// that forces the current token in.
TEST_F(CudaKernels, TopKRanksNaNLowestAndNegativeZeroAsZeroAsTheHostDoes) {
  const int kv_heads = 2;
  for (int64_t n : {17, 1000}) {
    std::vector<float> s(kv_heads * n);
    for (size_t i = 0; i < s.size(); ++i) {
      const uint32_t r = rng_() % 10;
      s[i] = r == 0   ? std::numeric_limits<float>::quiet_NaN()
             : r == 1 ? -0.0f
             : r == 2 ? 0.0f
                      : static_cast<float>(static_cast<int>(rng_() % 9)) - 4.0f;
    }
    s[n - 1] = std::numeric_limits<float>::max();  // the current token, as the selection forces it
    for (int64_t k : {int64_t{1}, n / 3 + 1, n}) {
      const std::vector<int32_t> got = DeviceTopK(s, kv_heads, n, k);
      EXPECT_EQ(got, HostTopK(s, kv_heads, n, k)) << "n " << n << " k " << k;
      EXPECT_NE(std::find(got.begin(), got.begin() + k, n - 1), got.begin() + k) << "k " << k;
    }
  }
}

TEST_F(CudaKernels, SpeculationChoosesTheHostRows) {
  const int batch = 2, heads = 8, kv_heads = 4, hd = 32, p = 7;
  const int64_t cap = 900;
  const std::vector<int32_t> rows = {900, 357};
  auto query = Random(batch * heads * hd);
  auto skew = Random(kv_heads * hd * p, 0.3f);
  auto keys = Random(batch * kv_heads * cap * p);
  Bf16(keys);  // the key cache is bf16 on the device; the reference reads the rounded values
  std::vector<uint16_t> keys16(keys.size());
  ConvertFromFloat(keys.data(), DType::kBF16, keys16.data(), keys.size());
  Dev<float> dq(query), dskew(skew), qp(batch * heads * p);
  Dev<uint16_t> dkeys(keys16);
  Dev<int32_t> drows(rows);
  cuda::PartialProjection proj;
  proj.x_type = cuda::Elem::kF32, proj.x = dq.p, proj.x_seq_stride = heads * hd;
  proj.batch = batch, proj.num_heads = heads, proj.num_kv_heads = kv_heads, proj.head_dim = hd;
  proj.partial_dim = p, proj.skew = dskew.p, proj.out = qp.p;
  proj.out_seq_stride = heads * p, proj.out_head_stride = p;
  CUDA_OK(cuda::RunPartialProjection(proj, nullptr));
  cuda::Speculation s;
  s.batch = batch, s.num_heads = heads, s.num_kv_heads = kv_heads, s.partial_dim = p;
  s.scale = 1.0f / std::sqrt(32.0f);
  s.q_partial = qp.p, s.key_type = cuda::Elem::kBF16, s.keys = dkeys.p;
  s.key_seq_stride = kv_heads * cap * p, s.key_head_stride = cap * p;
  s.num_rows = drows.p, s.max_rows = cap, s.alpha = 1.5f, s.budget_fraction = 0.2f, s.k_min = 3;
  s.index_capacity = cuda::SpeculationMaxBudget(0.2f, cap);
  Dev<int32_t> idx(batch * kv_heads * s.index_capacity), counts(batch);
  s.indices = idx.p, s.counts = counts.p;
  Dev<uint8_t> ws(cuda::SpeculationWorkspaceBytes(s));
  s.workspace = ws.p;
  CUDA_OK(cuda::RunSpeculation(s, nullptr));
  const auto got_idx = idx.Get(), got_counts = counts.Get();
  for (int b = 0; b < batch; ++b) {
    const int64_t n = rows[b];
    std::vector<float> scores(heads * n);
    // Scores within float rounding of a head's threshold may fall on either side on the GPU
    // (another summation order): the count may be any between the two readings.
    double count_lo = 0, count_hi = 0;
    for (int h = 0; h < heads; ++h) {
      const int g = h / (heads / kv_heads);
      std::vector<float> qpart(p, 0.0f);
      for (int c = 0; c < p; ++c) {
        for (int i = 0; i < hd; ++i)
          qpart[c] += query[(b * heads + h) * hd + i] * skew[(g * hd + i) * p + c];
      }
      for (int64_t j = 0; j < n; ++j) {
        float dot = 0;
        for (int c = 0; c < p; ++c) dot += qpart[c] * keys[((b * kv_heads + g) * cap + j) * p + c];
        scores[h * n + j] = dot * s.scale;
      }
      const float best = *std::max_element(&scores[h * n], &scores[h * n] + n);
      const float eps = 1e-4f * std::max(1.0f, std::abs(best));
      count_lo += std::count_if(&scores[h * n], &scores[h * n] + n,
                                [&](float x) { return x > best - 1.5f + eps; });
      count_hi += std::count_if(&scores[h * n], &scores[h * n] + n,
                                [&](float x) { return x > best - 1.5f - eps; });
    }
    const int64_t k_max = std::max<int64_t>(1, std::min<int64_t>(n, std::ceil(0.2f * n)));
    auto budget = [&](double count_sum) {
      return std::clamp<int64_t>(std::llround(count_sum / heads), std::min<int64_t>(3, k_max),
                                 k_max);
    };
    // At a mean count of exactly x.5 the rounding may go either way too.
    const int64_t k_lo = std::min(budget(count_lo - 1e-3 * heads), budget(count_lo));
    const int64_t k_hi = std::max(budget(count_hi + 1e-3 * heads), budget(count_hi));
    const int64_t k = got_counts[b];
    ASSERT_GE(k, k_lo) << "sequence " << b;
    ASSERT_LE(k, k_hi) << "sequence " << b;
    std::vector<float> mass;
    GroupAttentionMass(scores.data(), heads, kv_heads, n, mass);
    for (int g = 0; g < kv_heads; ++g) {
      std::vector<int32_t> want;
      TopK(&mass[g * n], n, k, {}, want);
      std::vector<int32_t> got(&got_idx[(b * kv_heads + g) * s.index_capacity],
                               &got_idx[(b * kv_heads + g) * s.index_capacity] + k);
      EXPECT_EQ(got, want) << "sequence " << b << " head " << g;
    }
  }
}

TEST_F(CudaKernels, GatherReadsHostMappedRowsAndScatterWritesThem) {
  for (int64_t row_bytes : {int64_t{256}, int64_t{36}, int64_t{50}}) {  // 16-, 4- and 2-byte paths
    const int batch = 2, kv_heads = 3;
    const int64_t cap = 500, count = 77;
    const size_t bytes = batch * kv_heads * cap * row_bytes;
    void* host = nullptr;
    CUDA_OK(cudaHostAlloc(&host, bytes, cudaHostAllocMapped));
    auto* h = static_cast<uint8_t*>(host);
    for (size_t i = 0; i < bytes; ++i) h[i] = static_cast<uint8_t>(rng_());
    void* mapped = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&mapped, host, 0));
    std::vector<int32_t> idx(batch * kv_heads * count), counts = {77, 40};
    for (auto& i : idx) i = static_cast<int32_t>(rng_() % cap);
    Dev<int32_t> didx(idx), dcounts(counts);
    Dev<uint8_t> staging(batch * kv_heads * count * row_bytes);
    cudaMemset(staging.p, 0, staging.n);
    cuda::Gather g;
    g.batch = batch, g.num_kv_heads = kv_heads, g.row_bytes = row_bytes, g.src = mapped;
    g.src_seq_stride = kv_heads * cap * row_bytes, g.src_head_stride = cap * row_bytes;
    g.indices = didx.p, g.index_capacity = count, g.counts = dcounts.p, g.max_count = count;
    g.dst = staging.p, g.dst_rows_per_head = count;
    CUDA_OK(cuda::RunGather(g, nullptr));
    const auto got = staging.Get();
    for (int b = 0; b < batch; ++b) {
      for (int hd = 0; hd < kv_heads; ++hd) {
        for (int64_t j = 0; j < count; ++j) {
          const uint8_t* dst = &got[((b * kv_heads + hd) * count + j) * row_bytes];
          if (j >= counts[b]) {
            EXPECT_EQ(dst[0], 0) << "row past the count was written";
            continue;
          }
          const int32_t row = idx[(b * kv_heads + hd) * count + j];
          ASSERT_EQ(std::memcmp(dst, h + ((b * kv_heads + hd) * cap + row) * row_bytes, row_bytes),
                    0)
              << "row_bytes " << row_bytes << " b " << b << " head " << hd << " j " << j;
        }
      }
    }
    // Scatter: each sequence's new rows land at its own position.
    std::vector<uint8_t> fresh(batch * kv_heads * row_bytes);
    for (auto& x : fresh) x = static_cast<uint8_t>(rng_());
    std::vector<int32_t> at = {499, 3};
    Dev<uint8_t> dfresh(fresh);
    Dev<int32_t> dat(at);
    CUDA_OK(cuda::ScatterRows(dfresh.p, kv_heads * row_bytes, batch, kv_heads, row_bytes, dat.p,
                              mapped, kv_heads * cap * row_bytes, cap * row_bytes, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    for (int b = 0; b < batch; ++b) {
      for (int hd = 0; hd < kv_heads; ++hd) {
        EXPECT_EQ(std::memcmp(h + ((b * kv_heads + hd) * cap + at[b]) * row_bytes,
                              &fresh[(b * kv_heads + hd) * row_bytes], row_bytes),
                  0);
      }
    }
    cudaFreeHost(host);
  }
}

TEST_F(CudaKernels, ArgmaxAndSamplingMatchTheHostSampler) {
  rng_.seed(20261122);  // fixed: a draw within float rounding of a boundary would flip
  const int64_t rows = 64, vocab = 1999;
  auto logits = Random(rows * vocab, 3.0f);
  logits[5 * vocab + 7] = logits[5 * vocab + 900] = 100.0f;  // a tie: the lower id wins
  Dev<float> dl(logits);
  Dev<int32_t> tokens(rows);
  CUDA_OK(cuda::Argmax(dl.p, rows, vocab, tokens.p, nullptr));
  auto got = tokens.Get();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = &logits[r * vocab];
    ASSERT_EQ(got[r], std::max_element(row, row + vocab) - row) << "row " << r;
  }
  std::vector<uint64_t> seeds(rows), positions(rows);
  for (int64_t r = 0; r < rows; ++r) seeds[r] = rng_(), positions[r] = r * 7 + 3;
  Dev<uint64_t> dseeds(seeds), dpos(positions);
  struct Case {
    int32_t top_k;
    float temperature, top_p, min_p;
  };
  for (Case c : {Case{1, 1.0f, 1.0f, 0.0f}, Case{5, 0.7f, 1.0f, 0.0f}, Case{50, 1.3f, 0.9f, 0.0f},
                 Case{256, 1.0f, 0.95f, 0.05f}}) {
    cuda::Sample s;
    s.logits = dl.p, s.rows = rows, s.vocab = vocab, s.temperature = c.temperature;
    s.top_k = c.top_k, s.top_p = c.top_p, s.min_p = c.min_p;
    s.seeds = dseeds.p, s.positions = dpos.p, s.tokens = tokens.p;
    CUDA_OK(cuda::RunSample(s, nullptr));
    got = tokens.Get();
    SamplingScratch scratch;
    for (int64_t r = 0; r < rows; ++r) {
      SamplingParams params;
      params.temperature = c.temperature, params.top_k = c.top_k, params.top_p = c.top_p;
      params.min_p = c.min_p, params.seed = seeds[r];
      std::vector<float> row(&logits[r * vocab], &logits[r * vocab] + vocab);
      EXPECT_EQ(got[r], SampleToken(row, params, {}, {}, positions[r], scratch))
          << "row " << r << " top_k " << c.top_k;
    }
  }
  cuda::Sample bad;
  bad.logits = dl.p, bad.rows = 1, bad.vocab = vocab, bad.top_k = 0;
  EXPECT_EQ(cuda::RunSample(bad, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace infinigen
