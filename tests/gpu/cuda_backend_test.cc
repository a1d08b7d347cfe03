// Every CudaBackend operation against CpuBackend (the reference) on odd sizes with fresh random
// inputs, in f32, f16 and bf16 storage. Inputs are rounded to the storage type first, so the
// tolerance covers only arithmetic order and the rounding of outputs. Skipped without a GPU.
#include "gpu_worker/backend/cuda_backend.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "kernels/cuda/device.h"

namespace infinigen {
namespace {

class CudaBackendOps : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    auto gpu = CudaBackend::Create({0, GetParam()});
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(*gpu);
    rng_.seed(std::random_device{}());
  }

  DType dtype() const { return GetParam(); }
  // CausalAttentionTilesAndGemms's cases on gpu_ against the CPU backend.
  void CausalAttentionCases();
  float Tolerance() const {
    return dtype() == DType::kF32 ? 2e-5f : dtype() == DType::kF16 ? 2e-3f : 1.6e-2f;
  }

  // Random values rounded to the storage type.
  std::vector<float> Random(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return Round(v);
  }
  std::vector<float> Round(std::vector<float> v) const {
    if (dtype() == DType::kF32) return v;
    std::vector<uint16_t> h(v.size());
    ConvertFromFloat(v.data(), dtype(), h.data(), v.size());
    ConvertToFloat(dtype(), h.data(), v.data(), v.size());
    return v;
  }

  // A GPU matrix of the storage type holding `v` ([rows, cols], row stride `stride`).
  MatView Up(const std::vector<float>& v, int64_t rows, int64_t cols, int64_t stride = 0) {
    stride = stride == 0 ? cols : stride;
    std::vector<uint8_t> bytes(v.size() * DTypeSize(dtype()));
    ConvertFromFloat(v.data(), dtype(), bytes.data(), v.size());
    auto buf = gpu_->Allocate(std::max<size_t>(bytes.size(), rows * stride * DTypeSize(dtype())));
    EXPECT_TRUE(buf.ok());
    EXPECT_TRUE(gpu_->CopyToDevice(bytes.data(), (*buf)->data(), bytes.size()).ok());
    MatView m{(*buf)->data(), dtype(), rows, cols, stride};
    buffers_.push_back(std::move(*buf));
    return m;
  }
  template <typename T>
  T* UpRaw(const std::vector<T>& v) {
    auto buf = gpu_->Allocate(v.size() * sizeof(T));
    EXPECT_TRUE(buf.ok());
    EXPECT_TRUE(gpu_->CopyToDevice(v.data(), (*buf)->data(), v.size() * sizeof(T)).ok());
    T* p = static_cast<T*>((*buf)->data());
    buffers_.push_back(std::move(*buf));
    return p;
  }
  std::vector<float> Down(const MatView& m) {
    EXPECT_TRUE(gpu_->Synchronize().ok());
    std::vector<uint8_t> bytes(m.rows * m.stride * DTypeSize(m.dtype));
    EXPECT_TRUE(gpu_->CopyToHost(m.data, bytes.data(), bytes.size()).ok());
    std::vector<float> all(m.rows * m.stride), out(m.rows * m.cols);
    ConvertToFloat(m.dtype, bytes.data(), all.data(), all.size());
    for (int64_t r = 0; r < m.rows; ++r) {
      std::copy_n(all.data() + r * m.stride, m.cols, out.data() + r * m.cols);
    }
    return out;
  }
  MatView Zeros(int64_t rows, int64_t cols) {
    return Up(std::vector<float>(rows * cols, 0.0f), rows, cols);
  }

  void ExpectNear(const std::vector<float>& got, const std::vector<float>& want) {
    ASSERT_EQ(got.size(), want.size());
    float worst = 0.0f;
    size_t at = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const float err = std::abs(got[i] - want[i]) / (1.0f + std::abs(want[i]));
      if (!(err <= worst)) worst = err, at = i;
    }
    EXPECT_LE(worst, Tolerance()) << "at " << at << ": got " << got[at] << ", want " << want[at];
  }

  std::unique_ptr<CudaBackend> gpu_;
  CpuBackend cpu_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::mt19937 rng_;
};

MatView HostMat(std::vector<float>& v, int64_t rows, int64_t cols) {
  return {v.data(), DType::kF32, rows, cols, cols};
}

TEST_P(CudaBackendOps, EmbeddingNormsAndElementwise) {
  const int64_t vocab = 37, rows = 13, cols = 203;
  auto table_host = Random(vocab * cols);
  std::vector<int32_t> ids(rows);
  for (auto& id : ids) id = static_cast<int32_t>(rng_() % vocab);
  auto table_gpu = gpu_->UploadWeight(table_host.data(), vocab, cols);
  auto table_cpu = cpu_.UploadWeight(table_host.data(), vocab, cols);
  ASSERT_TRUE(table_gpu.ok() && table_cpu.ok());
  MatView e = Zeros(rows, cols);
  ASSERT_TRUE(gpu_->Embedding(*table_gpu, UpRaw(ids), e).ok());
  std::vector<float> want(rows * cols);
  ASSERT_TRUE(cpu_.Embedding(*table_cpu, ids.data(), HostMat(want, rows, cols)).ok());
  ExpectNear(Down(e), want);

  // RmsNorm and LayerNorm (with and without bias), out of place.
  auto x = Random(rows * cols, 3.0f);
  auto w = Random(cols), b = Random(cols);
  auto w_gpu = gpu_->UploadWeight(w.data(), 1, cols), b_gpu = gpu_->UploadWeight(b.data(), 1, cols);
  auto w_cpu = cpu_.UploadWeight(w.data(), 1, cols), b_cpu = cpu_.UploadWeight(b.data(), 1, cols);
  MatView xg = Up(x, rows, cols), out = Zeros(rows, cols);
  ASSERT_TRUE(gpu_->RmsNorm(xg, *w_gpu, 1e-5f, out).ok());
  std::vector<float> xc = x;
  ASSERT_TRUE(cpu_.RmsNorm(HostMat(xc, rows, cols), *w_cpu, 1e-5f, HostMat(want, rows, cols)).ok());
  ExpectNear(Down(out), want);
  for (const Weight* bias :
       {static_cast<const Weight*>(nullptr), static_cast<const Weight*>(&*b_gpu)}) {
    ASSERT_TRUE(gpu_->LayerNorm(xg, *w_gpu, bias, 1e-5f, out).ok());
    ASSERT_TRUE(cpu_.LayerNorm(HostMat(xc, rows, cols), *w_cpu, bias ? &*b_cpu : nullptr, 1e-5f,
                               HostMat(want, rows, cols))
                    .ok());
    ExpectNear(Down(out), want);
  }

  // SwiGlu, Relu, Add on column slices of a wider matrix (strides != cols).
  auto wide = Random(rows * 2 * cols, 2.0f);
  MatView wg = Up(wide, rows, 2 * cols);
  MatView gate{wg.data, dtype(), rows, cols, 2 * cols};
  MatView up = gate;
  up.data = static_cast<uint8_t*>(wg.data) + cols * DTypeSize(dtype());
  ASSERT_TRUE(gpu_->SwiGlu(gate, up, out).ok());
  std::vector<float> wc = wide;
  ASSERT_TRUE(cpu_.SwiGlu({wc.data(), DType::kF32, rows, cols, 2 * cols},
                          {wc.data() + cols, DType::kF32, rows, cols, 2 * cols},
                          HostMat(want, rows, cols))
                  .ok());
  ExpectNear(Down(out), Round(want));
  ASSERT_TRUE(gpu_->Relu(xg).ok());
  for (float& v : xc) v = std::max(v, 0.0f);
  ExpectNear(Down(xg), xc);
  MatView y = Up(x, rows, cols);
  ASSERT_TRUE(gpu_->Add(xg, y).ok());
  for (size_t i = 0; i < x.size(); ++i) want[i] = x[i] + xc[i];
  ExpectNear(Down(y), Round(want));
}

TEST_P(CudaBackendOps, CopyConvertsBetweenTypes) {
  const int64_t rows = 5, cols = 77;
  auto x = Random(rows * cols);
  MatView src = Up(x, rows, cols);
  auto f32 = gpu_->Allocate(rows * cols * 4);
  ASSERT_TRUE(f32.ok());
  MatView dst{(*f32)->data(), DType::kF32, rows, cols, cols};
  ASSERT_TRUE(gpu_->Copy(src, dst).ok());
  EXPECT_EQ(Down(dst), x);  // widening is exact
}

TEST_P(CudaBackendOps, RopeBothLayoutsWithPartialRotation) {
  const int64_t rows = 9;
  const int heads = 3, head_dim = 18, rotary = 12;
  auto x = Random(rows * heads * head_dim);
  std::vector<int32_t> pos(rows);
  for (auto& p : pos) p = static_cast<int32_t>(rng_() % 5000);
  std::vector<float> inv_freq(rotary / 2);
  for (int i = 0; i < rotary / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / rotary);
  for (auto layout : {cpu::RopeLayout::kHalf, cpu::RopeLayout::kInterleaved}) {
    MatView xg = Up(x, rows, heads * head_dim);
    ASSERT_TRUE(gpu_->Rope(xg, heads, head_dim, rotary, UpRaw(pos), UpRaw(inv_freq), layout).ok());
    std::vector<float> want = x;
    ASSERT_TRUE(cpu_.Rope(HostMat(want, rows, heads * head_dim), heads, head_dim, rotary,
                          pos.data(), inv_freq.data(), layout)
                    .ok());
    ExpectNear(Down(xg), Round(want));
  }
}

TEST_P(CudaBackendOps, LinearWithBiasAndAccumulate) {
  const int64_t m = 7, n = 77, k = 131;
  auto x = Random(m * k), w = Random(n * k, 0.1f), b = Random(n), y0 = Random(m * n);
  auto wg = gpu_->UploadWeight(w.data(), n, k), bg = gpu_->UploadWeight(b.data(), 1, n);
  auto wc = cpu_.UploadWeight(w.data(), n, k), bc = cpu_.UploadWeight(b.data(), 1, n);
  ASSERT_TRUE(wg.ok() && bg.ok());
  for (bool accumulate : {false, true}) {
    MatView xg = Up(x, m, k), yg = Up(y0, m, n);
    ASSERT_TRUE(gpu_->Linear(xg, *wg, &*bg, yg, accumulate).ok());
    std::vector<float> xc = x, want = y0;
    ASSERT_TRUE(cpu_.Linear(HostMat(xc, m, k), *wc, &*bc, HostMat(want, m, n), accumulate).ok());
    ExpectNear(Down(yg), Round(want));
  }
  // Logits: activations of the storage type in, float32 out.
  auto logits = gpu_->Allocate(m * n * 4);
  MatView lg{(*logits)->data(), DType::kF32, m, n, n};
  ASSERT_TRUE(gpu_->Linear(Up(x, m, k), *wg, nullptr, lg, false).ok());
  std::vector<float> xc = x, want(m * n);
  ASSERT_TRUE(cpu_.Linear(HostMat(xc, m, k), *wc, nullptr, HostMat(want, m, n), false).ok());
  ExpectNear(Down(lg), want);
  // A mismatched shape is an error, not a crash.
  EXPECT_EQ(gpu_->Linear(Up(x, m, k), *wg, nullptr, Zeros(m, n + 1), false).code(),
            absl::StatusCode::kInvalidArgument);
}

struct AttnCase {
  int heads, kv_heads, head_dim;
  int64_t q_start, num_q;
};

// Through the tiled kernel, and (CudaBackendOptions::gemm_causal_attention) from 128 query rows
// in 16-bit types through GEMMs (cuBLAS scores, the causal softmax, cuBLAS output; in two chunks
// of query rows at 1100).
TEST_P(CudaBackendOps, CausalAttentionTilesAndGemms) {
  unsetenv("INFINIGEN_CUDA_CAUSAL");  // which path runs is this test's choice
  for (bool gemm : {false, true}) {
    SCOPED_TRACE(gemm ? "gemms" : "tiles");
    auto g = CudaBackend::Create({0, GetParam(), /*gemm_causal_attention=*/gemm});
    ASSERT_TRUE(g.ok()) << g.status();
    // What admission sets aside for the GEMMs' scores (float32) and probabilities (16-bit) of a
    // chunk: 64M of each, none where the tiles run.
    EXPECT_EQ((*g)->ScratchBytes(), gemm && dtype() != DType::kF32 ? (size_t{64} << 20) * 6 : 0);
    buffers_.clear();
    gpu_ = std::move(*g);
    CausalAttentionCases();
  }
}

void CudaBackendOps::CausalAttentionCases() {
  for (AttnCase c :
       {AttnCase{6, 3, 20, 11, 37}, AttnCase{4, 4, 18, 0, 5}, AttnCase{8, 2, 128, 40, 70},
        AttnCase{2, 1, 256, 3, 20}, AttnCase{8, 2, 128, 100, 300}, AttnCase{6, 3, 40, 0, 130},
        AttnCase{4, 2, 64, 7, 1100}}) {
    const int64_t total = c.q_start + c.num_q;
    const int64_t qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
    auto q = Random(c.num_q * qd), k = Random(total * kvd), v = Random(total * kvd);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    const AttentionShape shape{c.heads, c.kv_heads, c.head_dim, scale};
    // K/V token-major: row j of head g at g * head_dim + j * kvd.
    MatView kg = Up(k, total, kvd), vg = Up(v, total, kvd), out = Zeros(c.num_q, qd);
    ASSERT_TRUE(gpu_->AttentionCausal(Up(q, c.num_q, qd), {kg.data, dtype(), c.head_dim, kvd},
                                      {vg.data, dtype(), c.head_dim, kvd}, c.q_start, shape, out)
                    .ok());
    std::vector<float> want(c.num_q * qd);
    ASSERT_TRUE(cpu_.AttentionCausal(HostMat(q, c.num_q, qd),
                                     {k.data(), DType::kF32, c.head_dim, kvd},
                                     {v.data(), DType::kF32, c.head_dim, kvd}, c.q_start, shape,
                                     HostMat(want, c.num_q, qd))
                    .ok());
    SCOPED_TRACE(testing::Message()
                 << "head_dim " << c.head_dim << " q_start " << c.q_start << " rows " << c.num_q);
    ExpectNear(Down(out), Round(want));
  }
}

TEST_P(CudaBackendOps, DecodeAttentionOverListedRowsWithWeights) {
  struct Case {
    int heads, kv_heads, head_dim;
    int64_t stored, rows;
    bool listed;
  };
  for (Case c : {Case{6, 3, 12, 50, 17, true}, Case{32, 8, 128, 3000, 3000, false},
                 Case{8, 1, 64, 5000, 999, true}, Case{5, 5, 40, 7, 7, false}}) {
    const int64_t qd = c.heads * c.head_dim;
    auto q = Random(qd, 2.0f), k = Random(c.kv_heads * c.stored * c.head_dim),
         v = Random(c.kv_heads * c.stored * c.head_dim);
    std::vector<int32_t> idx;
    if (c.listed) {  // each head its own unsorted subset
      for (int g = 0; g < c.kv_heads; ++g) {
        std::vector<int32_t> all(c.stored);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng_);
        idx.insert(idx.end(), all.begin(), all.begin() + c.rows);
      }
    }
    const AttentionShape shape{c.heads, c.kv_heads, c.head_dim,
                               1.0f / std::sqrt(static_cast<float>(c.head_dim))};
    // Head-major K/V: [kv_heads, stored, head_dim].
    MatView kg = Up(k, c.kv_heads * c.stored, c.head_dim),
            vg = Up(v, c.kv_heads * c.stored, c.head_dim);
    const KvView kv_k{kg.data, dtype(), c.stored * c.head_dim, c.head_dim};
    const KvView kv_v{vg.data, dtype(), c.stored * c.head_dim, c.head_dim};
    MatView out = Zeros(1, qd);
    auto weights = gpu_->Allocate(c.heads * c.rows * 4);
    ASSERT_TRUE(gpu_->AttentionDecode(Up(q, 1, qd), kv_k, kv_v, c.listed ? UpRaw(idx) : nullptr,
                                      c.rows, shape, out, static_cast<float*>((*weights)->data()))
                    .ok());
    std::vector<float> want(qd), want_w(c.heads * c.rows), got_w(c.heads * c.rows);
    ASSERT_TRUE(cpu_.AttentionDecode(HostMat(q, 1, qd),
                                     {k.data(), DType::kF32, c.stored * c.head_dim, c.head_dim},
                                     {v.data(), DType::kF32, c.stored * c.head_dim, c.head_dim},
                                     c.listed ? idx.data() : nullptr, c.rows, shape,
                                     HostMat(want, 1, qd), want_w.data())
                    .ok());
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " head_dim " << c.head_dim);
    ExpectNear(Down(out), Round(want));
    ASSERT_TRUE(gpu_->CopyToHost((*weights)->data(), got_w.data(), got_w.size() * 4).ok());
    ExpectNear(got_w, want_w);
  }
}

// The batch's decode attention in one launch (AttentionDecodeBatch) gives each sequence
// exactly what AttentionDecode of it alone gives, bit for bit: sequences of very different row
// counts (so different splits), listed and unlisted rows, each in its own buffers.
TEST_P(CudaBackendOps, DecodeAttentionOfABatchEqualsEachAloneBitForBit) {
  const int heads = 32, kv_heads = 8, head_dim = 128;
  const int64_t qd = heads * head_dim;
  const AttentionShape shape{heads, kv_heads, head_dim, 1.0f / std::sqrt(128.0f)};
  struct Seq {
    int64_t stored, rows;
    bool listed;
  };
  const std::vector<Seq> seqs = {
      {50, 17, true}, {3000, 3000, false}, {9000, 1200, true}, {7, 7, false}, {600, 64, true}};
  std::vector<DecodeAttentionItem> items;
  std::vector<MatView> alone;
  for (const Seq& c : seqs) {
    auto q = Random(qd, 2.0f), k = Random(kv_heads * c.stored * head_dim),
         v = Random(kv_heads * c.stored * head_dim);
    std::vector<int32_t> idx;
    for (int g = 0; g < kv_heads && c.listed; ++g) {
      std::vector<int32_t> all(c.stored);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng_);
      idx.insert(idx.end(), all.begin(), all.begin() + c.rows);
    }
    MatView kg = Up(k, kv_heads * c.stored, head_dim), vg = Up(v, kv_heads * c.stored, head_dim);
    DecodeAttentionItem it;
    it.q = Up(q, 1, qd);
    it.k = {kg.data, dtype(), c.stored * head_dim, head_dim};
    it.v = {vg.data, dtype(), c.stored * head_dim, head_dim};
    it.indices = c.listed ? UpRaw(idx) : nullptr;
    it.num_rows = c.rows;
    it.out = Zeros(1, qd);
    items.push_back(it);
    alone.push_back(Zeros(1, qd));
    ASSERT_TRUE(
        gpu_->AttentionDecode(it.q, it.k, it.v, it.indices, it.num_rows, shape, alone.back()).ok());
  }
  const BackendCounters before = gpu_->counters();
  ASSERT_TRUE(gpu_->AttentionDecodeBatch(items, shape).ok());
  const BackendCounters used = gpu_->counters() - before;
  EXPECT_EQ(used.synchronizations + used.copies_to_host, 0) << "queued: no wait";
  EXPECT_LE(used.copies_to_device, 1) << "the descriptors, once";
  for (size_t b = 0; b < items.size(); ++b) {
    EXPECT_EQ(Down(items[b].out), Down(alone[b])) << "sequence " << b;
  }
}

// Decode attention whose row counts lie in device memory (a choice made there) against the
// same lists cut to their counts on the host: one launch, no wait, and within the dtype's
// tolerance of the packed lists' attention (the split is the bound's, not the count's).
TEST_P(CudaBackendOps, DecodeAttentionOverDeviceCountsIsThePackedListsAttention) {
  const int heads = 32, kv_heads = 8, head_dim = 128;
  const int64_t qd = heads * head_dim, stored = 5000, bound = 1500;
  const AttentionShape shape{heads, kv_heads, head_dim, 1.0f / std::sqrt(128.0f)};
  auto k = Random(kv_heads * stored * head_dim), v = Random(kv_heads * stored * head_dim);
  MatView kg = Up(k, kv_heads * stored, head_dim), vg = Up(v, kv_heads * stored, head_dim);
  const KvView kk{kg.data, dtype(), stored * head_dim, head_dim};
  const KvView vv{vg.data, dtype(), stored * head_dim, head_dim};
  std::vector<DecodeAttentionItem> items;
  std::vector<MatView> want;
  for (int32_t n : {1, 700, 1500, 0, 2000}) {
    std::vector<int32_t> lists(kv_heads * bound), packed;
    for (int32_t& r : lists) r = static_cast<int32_t>(rng_() % stored);
    const int64_t rows = std::clamp<int64_t>(n, 0, bound);
    for (int g = 0; g < kv_heads; ++g) {
      packed.insert(packed.end(), lists.begin() + g * bound, lists.begin() + g * bound + rows);
    }
    DecodeAttentionItem it;
    it.q = Up(Random(qd, 2.0f), 1, qd);
    it.k = kk;
    it.v = vv;
    it.indices = UpRaw(lists);
    it.num_rows = bound;
    it.count = UpRaw(std::vector<int32_t>{n});
    it.out = Zeros(1, qd);
    items.push_back(it);
    want.push_back(Zeros(1, qd));
    if (rows > 0) {
      ASSERT_TRUE(
          gpu_->AttentionDecode(it.q, kk, vv, UpRaw(packed), rows, shape, want.back()).ok());
    }
  }
  const BackendCounters before = gpu_->counters();
  ASSERT_TRUE(gpu_->AttentionDecodeBatch(items, shape).ok());
  const BackendCounters used = gpu_->counters() - before;
  EXPECT_EQ(used.synchronizations + used.copies_to_host, 0) << "queued: no wait";
  for (size_t b = 0; b < items.size(); ++b) {
    SCOPED_TRACE(b);
    ExpectNear(Down(items[b].out), Down(want[b]));
  }
}

// PlanKeptRows and MapKeptRows on the device against the CPU's plain loops, over several steps
// of overlapping lists longer than a thread block (so that the prefix sums carry over chunks),
// with slots outside the map, lists past the rows and misses past their room: the same rows,
// moves, counts and errors, bit for bit (both take the lowest free row, in list order).
TEST(CudaBackend, KeptRowsPlansAndMapsEqualTheCpuLoops) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto made = CudaBackend::Create({0, DType::kBF16});
  ASSERT_TRUE(made.ok()) << made.status();
  CudaBackend& gpu = **made;
  CpuBackend cpu;
  constexpr int kHeads = 5;
  constexpr int64_t kSlots = 9000, kRows = 1300, kCap = 1400, kMiss = 40;
  std::mt19937 rng(21);
  std::vector<std::unique_ptr<Buffer>> keep_alive;
  auto up = [&](const std::vector<int32_t>& v) {
    auto b = gpu.Allocate(std::max<size_t>(4, v.size() * 4));
    EXPECT_TRUE(b.ok());
    EXPECT_TRUE(gpu.CopyToDevice(v.data(), (*b)->data(), v.size() * 4).ok());
    int32_t* p = static_cast<int32_t*>((*b)->data());
    keep_alive.push_back(std::move(*b));
    return p;
  };
  auto down = [&](const int32_t* p, size_t n) {
    std::vector<int32_t> v(n);
    EXPECT_TRUE(gpu.CopyToHost(p, v.data(), n * 4).ok());
    return v;
  };
  std::vector<int32_t> row_of(kHeads * kSlots, -1), slot_of(kHeads * kRows, -1);
  int32_t* d_row_of = up(row_of);
  int32_t* d_slot_of = up(slot_of);
  std::vector<std::vector<int32_t>> last(kHeads);
  // The last step lists every row (a dense layer's lists: no slots, no count in memory).
  constexpr int64_t kDense = 1200;
  for (int step = 0; step < 13; ++step) {
    SCOPED_TRACE(step);
    const bool dense = step == 12;
    const int64_t cap = dense ? kDense : kCap;  // the lists' stride
    const int32_t count = step == 5 ? kCap : 900 + static_cast<int32_t>(rng() % 400);
    std::vector<int32_t> list(kHeads * kCap, -1);
    for (int g = 0; g < kHeads; ++g) {
      std::set<int32_t> chosen;
      for (int32_t s : last[g]) {
        if (rng() % 10 < 8 && static_cast<int32_t>(chosen.size()) < count) chosen.insert(s);
      }
      while (static_cast<int32_t>(chosen.size()) < count) chosen.insert(rng() % kSlots);
      last[g].assign(chosen.begin(), chosen.end());
      std::copy(last[g].begin(), last[g].end(), list.begin() + g * kCap);
    }
    if (step == 7) list[0] = -3, list[kCap + count - 1] = kSlots + 2;  // outside the map
    const bool keep = step != 9;
    // The CPU.
    std::vector<int32_t> moves(kHeads * kCap, -1), move_rows(kHeads * kCap, -1),
        move_counts(kHeads, -1), work(kHeads * kRows);
    int32_t errors = 0;
    KeptRowsPlan p;
    p.kept = {kHeads, row_of.data(), kSlots, slot_of.data(), kRows};
    p.list = dense ? DeviceSlotList{nullptr, nullptr, kDense, kDense}
                   : DeviceSlotList{list.data(), &count, kCap, kCap};
    p.keep = keep;
    p.move_slots = moves.data();
    p.move_rows = move_rows.data();
    p.move_counts = move_counts.data();
    p.workspace = work.data();
    p.errors = &errors;
    ASSERT_TRUE(cpu.PlanKeptRows(p).ok());
    // The GPU.
    KeptRowsPlan d = p;
    d.kept = {kHeads, d_row_of, kSlots, d_slot_of, kRows};
    d.list = dense ? p.list : DeviceSlotList{up(list), up({count}), kCap, kCap};
    d.move_slots = up(std::vector<int32_t>(kHeads * kCap, -1));
    d.move_rows = up(std::vector<int32_t>(kHeads * kCap, -1));
    d.move_counts = up(std::vector<int32_t>(kHeads, -1));
    d.listed = up(std::vector<int32_t>(kHeads, -1));
    d.workspace = up(work);
    d.errors = up({0});
    // Every other step on the side queue, as the decode step plans (forked, then joined).
    d.on_side_queue = step % 2 == 1;
    const BackendCounters before = gpu.counters();
    if (d.on_side_queue) ASSERT_TRUE(gpu.ForkSideQueue().ok());
    ASSERT_TRUE(gpu.PlanKeptRows(d).ok());
    if (d.on_side_queue) ASSERT_TRUE(gpu.JoinSideQueue().ok());
    EXPECT_EQ((gpu.counters() - before).synchronizations, 0);
    const std::vector<int32_t> got_counts = down(d.move_counts, kHeads);
    EXPECT_EQ(got_counts, move_counts);
    EXPECT_EQ(down(d.listed, kHeads),
              std::vector<int32_t>(kHeads, dense ? kDense : std::min<int32_t>(count, kCap)));
    EXPECT_EQ(down(d.errors, 1)[0], errors);
    EXPECT_EQ(down(d_row_of, row_of.size()), row_of);
    EXPECT_EQ(down(d_slot_of, slot_of.size()), slot_of);
    const std::vector<int32_t> got_moves = down(d.move_slots, moves.size()),
                               got_rows = down(d.move_rows, moves.size());
    for (int g = 0; g < kHeads; ++g) {
      for (int32_t i = 0; i < move_counts[g]; ++i) {
        ASSERT_EQ(got_moves[g * cap + i], moves[g * cap + i]) << g << " " << i;
        ASSERT_EQ(got_rows[g * cap + i], move_rows[g * cap + i]) << g << " " << i;
      }
    }
    // A choice: most of the list, the current token, and slots not kept.
    std::vector<int32_t> choice(kHeads * kCap, -1);
    const int32_t current = dense ? kDense : kSlots - 1;
    for (int g = 0; g < kHeads; ++g) {
      std::set<int32_t> c;
      for (int32_t j = 0; j < count; ++j) {
        if (rng() % 4 != 0) c.insert(list[g * kCap + j]);
      }
      for (int m = 0; m < (step % 3) * 30; ++m) c.insert(rng() % kSlots);
      c.insert(current);
      std::vector<int32_t> v(c.begin(), c.end());
      v.resize(std::min<size_t>(v.size(), kCap));
      std::copy(v.begin(), v.end(), choice.begin() + g * kCap);
    }
    const int32_t choice_count = dense ? kDense + 1 : 800;
    const int64_t choice_cap = dense ? kDense + 1 : kCap;
    std::vector<int32_t> out(kHeads * kCap, -1), miss_slots(kHeads * kCap, -1),
        miss_counts(kHeads, -1);
    int32_t map_errors = 0;
    KeptRowsMap m;
    m.kept = p.kept;
    m.list = dense ? DeviceSlotList{nullptr, nullptr, kDense + 1, kDense + 1}
                   : DeviceSlotList{choice.data(), &choice_count, kCap, kCap};
    m.head_rows = kRows;
    m.current_slot = current;
    m.current_row = kHeads * kRows;
    m.miss_row = kHeads * kRows + kHeads;
    m.miss_capacity = kMiss;
    m.out = out.data();
    m.miss_slots = miss_slots.data();
    m.miss_counts = miss_counts.data();
    m.errors = &map_errors;
    ASSERT_TRUE(cpu.MapKeptRows(m).ok());
    KeptRowsMap dm = m;
    dm.kept = d.kept;
    dm.list = dense ? m.list : DeviceSlotList{up(choice), up({choice_count}), kCap, kCap};
    dm.out = up(std::vector<int32_t>(kHeads * kCap, -1));
    dm.miss_slots = up(std::vector<int32_t>(kHeads * kCap, -1));
    dm.miss_counts = up(std::vector<int32_t>(kHeads, -1));
    dm.errors = up({0});
    ASSERT_TRUE(gpu.MapKeptRows(dm).ok());
    EXPECT_EQ(down(dm.miss_counts, kHeads), miss_counts);
    EXPECT_EQ(down(dm.errors, 1)[0], map_errors);
    const std::vector<int32_t> got_out = down(dm.out, out.size()),
                               got_miss = down(dm.miss_slots, out.size());
    for (int g = 0; g < kHeads; ++g) {
      for (int32_t j = 0; j < choice_count; ++j) {
        ASSERT_EQ(got_out[g * choice_cap + j], out[g * choice_cap + j]) << g << " " << j;
      }
      for (int32_t i = 0; i < miss_counts[g]; ++i) {
        ASSERT_EQ(got_miss[g * choice_cap + i], miss_slots[g * choice_cap + i]) << g << " " << i;
      }
    }
  }
}

// InfiniGen's partial keys (appended in two pieces, the second at an offset) and the choice of
// rows over them, against CpuBackend's (the host policy's arithmetic). Both choose over the same
// keys (the CPU's, uploaded), so only the scores' summation and the exponentials differ: the
// counts agree within one (a score at the alpha boundary) and nearly every row is the same.
TEST_P(CudaBackendOps, PartialKeysAndTheChoiceOfRowsMatchTheCpu) {
  struct Case {
    int heads, kv_heads, head_dim, partial_dim;
    int64_t rows;
  };
  for (Case c : {Case{32, 8, 128, 26, 3000}, Case{9, 3, 64, 17, 777}, Case{4, 4, 40, 9, 300}}) {
    SCOPED_TRACE(testing::Message() << c.heads << " heads, " << c.rows << " rows");
    const int64_t width = int64_t{c.kv_heads} * c.head_dim, n = c.rows;
    const PartialKeysShape shape{c.kv_heads, c.head_dim, c.partial_dim, n + 5};
    auto k = Random(n * width);
    std::normal_distribution<float> normal(0.0f, 0.3f);
    std::vector<float> skew(static_cast<size_t>(c.kv_heads) * c.head_dim * c.partial_dim);
    for (float& x : skew) x = normal(rng_);
    std::vector<uint16_t> cpu_keys(shape.Bytes() / 2);
    MatView k_cpu = HostMat(k, n, width);
    ASSERT_TRUE(
        cpu_.AppendPartialKeys(k_cpu.Rows(0, n - 1), skew.data(), shape, cpu_keys.data(), 0).ok());
    ASSERT_TRUE(
        cpu_.AppendPartialKeys(k_cpu.Rows(n - 1, 1), skew.data(), shape, cpu_keys.data(), n - 1)
            .ok());
    MatView k_gpu = Up(k, n, width);
    auto gpu_keys = gpu_->Allocate(shape.Bytes());
    ASSERT_TRUE(gpu_keys.ok());
    const float* skew_gpu = UpRaw(skew);
    ASSERT_TRUE(
        gpu_->AppendPartialKeys(k_gpu.Rows(0, n - 1), skew_gpu, shape, (*gpu_keys)->data(), 0)
            .ok());
    ASSERT_TRUE(
        gpu_->AppendPartialKeys(k_gpu.Rows(n - 1, 1), skew_gpu, shape, (*gpu_keys)->data(), n - 1)
            .ok());
    std::vector<uint16_t> got_keys(cpu_keys.size());
    ASSERT_TRUE(gpu_->CopyToHost((*gpu_keys)->data(), got_keys.data(), shape.Bytes()).ok());
    float worst = 0.0f;
    for (int64_t ch = 0; ch < int64_t{c.kv_heads} * c.partial_dim; ++ch) {
      for (int64_t j = 0; j < n; ++j) {
        const size_t at = static_cast<size_t>(ch * shape.capacity + j);
        const float want = Bf16ToFloat(cpu_keys[at]), got = Bf16ToFloat(got_keys[at]);
        worst = std::max(worst, std::abs(got - want) / (1.0f + std::abs(want)));
      }
    }
    EXPECT_LE(worst, 1.6e-2f) << "partial keys";

    const uint16_t* keys_for_both = UpRaw(cpu_keys);
    auto q = Random(static_cast<size_t>(c.heads) * c.partial_dim, 3.0f);
    for (const bool prefetch : {true, false}) {
      SCOPED_TRACE(prefetch ? "prefetch" : "the layer's own choice");
      const int64_t k_max = (n + 4) / 5, capacity = std::min(n, k_max + 1 + k_max / 16 + 2);
      RowChoiceRequest r;
      r.keys_shape = shape;
      r.num_heads = c.heads;
      r.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      r.alpha = 2.0f;
      r.rows = n;
      r.k_min = 1;
      r.k_max = k_max;
      r.margin = prefetch;
      r.force_last = !prefetch;
      r.index_capacity = capacity;
      std::vector<int32_t> want(static_cast<size_t>(c.kv_heads * capacity)), got(want.size());
      int32_t want_count = 0, got_count = 0;
      RowChoiceRequest on_cpu = r;
      on_cpu.q_partial = HostMat(q, 1, static_cast<int64_t>(q.size()));
      on_cpu.keys = cpu_keys.data();
      on_cpu.indices = want.data();
      on_cpu.count = &want_count;
      ASSERT_TRUE(cpu_.ChooseRows(on_cpu, nullptr).ok());
      RowChoiceRequest on_gpu = r;
      on_gpu.q_partial = Up(q, 1, static_cast<int64_t>(q.size()));
      on_gpu.keys = keys_for_both;
      on_gpu.indices = UpRaw(got);
      on_gpu.count = UpRaw(std::vector<int32_t>{0});
      auto workspace = gpu_->Allocate(gpu_->ChooseRowsWorkspaceBytes(c.heads, c.kv_heads, n));
      ASSERT_TRUE(workspace.ok());
      ASSERT_TRUE(gpu_->ChooseRows(on_gpu, (*workspace)->data()).ok());
      ASSERT_TRUE(gpu_->CopyToHost(on_gpu.count, &got_count, sizeof(int32_t)).ok());
      ASSERT_TRUE(gpu_->CopyToHost(on_gpu.indices, got.data(), got.size() * 4).ok());
      EXPECT_LE(std::abs(got_count - want_count), 1);
      ASSERT_GT(got_count, 0);
      ASSERT_LE(got_count, capacity);
      const int64_t common_count = std::min(got_count, want_count);
      int64_t shared = 0, total = 0;
      for (int g = 0; g < c.kv_heads; ++g) {
        const int32_t* w = want.data() + g * capacity;
        const int32_t* h = got.data() + g * capacity;
        EXPECT_TRUE(std::is_sorted(h, h + got_count));
        if (!prefetch) {
          EXPECT_EQ(h[got_count - 1], n - 1) << "the current token";
        }
        for (int64_t j = 0; j < common_count; ++j) {
          shared += std::binary_search(w, w + want_count, h[j]);
        }
        total += common_count;
      }
      EXPECT_GE(static_cast<double>(shared), 0.97 * static_cast<double>(total));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, CudaBackendOps,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// Rows of a read-only shared mapping (as the KV store's arena is mapped by a shm worker),
// registered with the backend and gathered by address in any order; an address outside the
// registered memory is refused.
TEST(CudaBackend, GatherRowsReadsRegisteredReadOnlyHostMemory) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto gpu = CudaBackend::Create({0, DType::kF32});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  constexpr size_t kRowBytes = 256, kRows = 4096;
  const int fd = ::memfd_create("gather-rows-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, kRows * kRowBytes), 0);
  std::vector<uint8_t> bytes(kRows * kRowBytes);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 131 + i / 7);
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  void* map = ::mmap(nullptr, bytes.size(), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(map, MAP_FAILED);
  const auto* base = static_cast<const uint8_t*>(map);
  ASSERT_TRUE((*gpu)->RegisterHostMemory(map, bytes.size()).ok());
  ASSERT_TRUE((*gpu)->RegisterHostMemory(map, bytes.size()).ok()) << "again: a no-op";

  std::mt19937 rng(7);
  std::vector<const void*> rows(1000);
  std::vector<size_t> picked(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    picked[i] = rng() % kRows;
    rows[i] = base + picked[i] * kRowBytes;
  }
  auto dst = (*gpu)->Allocate(rows.size() * kRowBytes);
  ASSERT_TRUE(dst.ok()) << dst.status();
  ASSERT_TRUE((*gpu)->GatherRows(rows.data(), rows.size(), kRowBytes, (*dst)->data()).ok());
  std::vector<uint8_t> got(rows.size() * kRowBytes);
  ASSERT_TRUE((*gpu)->CopyToHost((*dst)->data(), got.data(), got.size()).ok());
  for (size_t i = 0; i < rows.size(); ++i) {
    ASSERT_EQ(
        std::memcmp(got.data() + i * kRowBytes, bytes.data() + picked[i] * kRowBytes, kRowBytes), 0)
        << "row " << i;
  }
  // 2-byte rows at odd offsets take the narrowest access.
  std::vector<const void*> narrow = {base + 2, base + 4094, base + 10};
  auto small = (*gpu)->Allocate(6);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE((*gpu)->GatherRows(narrow.data(), 3, 2, (*small)->data()).ok());
  uint8_t six[6];
  ASSERT_TRUE((*gpu)->CopyToHost((*small)->data(), six, 6).ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(std::memcmp(six + 2 * i, narrow[i], 2), 0) << i;
  }

  std::vector<uint8_t> elsewhere(kRowBytes);
  const void* outside = elsewhere.data();
  EXPECT_EQ((*gpu)->GatherRows(&outside, 1, kRowBytes, (*dst)->data()).code(),
            absl::StatusCode::kInvalidArgument);
  // Unregistered after the mapping went (a restarted store's arena, replaced): its rows are
  // refused from then on, and registering a new mapping works.
  ::munmap(map, bytes.size());
  EXPECT_TRUE((*gpu)->UnregisterHostMemory(map).ok());
  EXPECT_EQ((*gpu)->GatherRows(rows.data(), 1, kRowBytes, (*dst)->data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*gpu)->UnregisterHostMemory(map).ok()) << "again: a no-op";
  std::vector<uint8_t> fresh(kRowBytes, 0x5a);
  ASSERT_TRUE((*gpu)->RegisterHostMemory(fresh.data(), fresh.size()).ok());
  const void* fresh_row = fresh.data();
  ASSERT_TRUE((*gpu)->GatherRows(&fresh_row, 1, kRowBytes, (*dst)->data()).ok());
  std::vector<uint8_t> back(kRowBytes);
  ASSERT_TRUE((*gpu)->CopyToHost((*dst)->data(), back.data(), back.size()).ok());
  EXPECT_EQ(back, fresh);
  EXPECT_TRUE((*gpu)->UnregisterHostMemory(fresh.data()).ok());
  gpu->reset();
}

// GatherBlockRows on the GPU equals the CPU backend's loop (its reference) byte for byte, errors
// counted alike: a batch's lists read from a registered read-only mapping by block table, with
// per-sequence counts (negative, short, full, above the bound), bad slots and bad blocks; 16-byte
// and 2-byte accesses; on the backend's stream and on its side queue (forked and joined); rows
// placed by dst_rows. An arena outside registered memory is refused.
TEST(CudaBackend, GatherBlockRowsEqualsTheCpuLoop) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  struct Layout {
    int64_t row_bytes, rows_per_block;
    size_t block_bytes;
  };
  for (const Layout& layout : {Layout{256, 16, 16 * 256 + 256}, Layout{6, 5, 34}}) {
    SCOPED_TRACE(layout.row_bytes);
    auto gpu = CudaBackend::Create({0, DType::kBF16});
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    constexpr int kBatch = 4, kHeads = 8;
    // Three different sizes, so that a stride taken for another fails.
    constexpr int64_t kTable = 24, kMax = 300, kSlots = 310, kDstRows = 305;
    const int64_t lists = kBatch * kHeads, blocks = lists * kTable;
    const size_t arena_bytes = static_cast<size_t>(blocks) * layout.block_bytes;
    const int fd = ::memfd_create("gather-block-rows-test", MFD_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(arena_bytes)), 0);
    std::mt19937 rng(11);
    std::vector<uint8_t> bytes(arena_bytes);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
    ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
    void* map = ::mmap(nullptr, arena_bytes, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    ASSERT_NE(map, MAP_FAILED);
    ASSERT_TRUE((*gpu)->RegisterHostMemory(map, arena_bytes).ok());

    std::vector<int32_t> tables(static_cast<size_t>(blocks));
    std::iota(tables.begin(), tables.end(), 0);
    std::shuffle(tables.begin(), tables.end(), rng);
    tables[5] = -1;                                     // list 0: a block that is not there
    tables[kTable + 2] = static_cast<int32_t>(blocks);  // list 1: one past the arena
    std::vector<int32_t> slots(static_cast<size_t>(lists * kSlots));
    std::uniform_int_distribution<int32_t> slot(
        0, static_cast<int32_t>(kTable * layout.rows_per_block) - 1);
    for (int32_t& s : slots) s = slot(rng);
    for (int64_t j = 0; j < 40; ++j) slots[2 * kSlots + j] = static_cast<int32_t>(j);  // a run
    slots[3] = -7;
    slots[4] = static_cast<int32_t>(kTable * layout.rows_per_block);
    const std::vector<int32_t> counts = {kMax, -5, 17, kMax + 40};

    BlockRowsGather g;
    g.arena = map;
    g.arena_bytes = arena_bytes;
    g.block_bytes = layout.block_bytes;
    g.rows_per_block = layout.rows_per_block;
    g.row_bytes = layout.row_bytes;
    g.batch = kBatch;
    g.num_kv_heads = kHeads;
    g.table_capacity = kTable;
    g.slot_capacity = kSlots;
    g.max_count = kMax;
    g.dst_rows_per_list = kDstRows;
    const size_t dst_bytes = static_cast<size_t>(lists * kDstRows * layout.row_bytes);

    // The reference on the host.
    std::vector<uint8_t> want(dst_bytes, 0xab);
    int32_t want_errors = 0;
    BlockRowsGather host = g;
    host.tables = tables.data();
    host.slots = slots.data();
    host.counts = counts.data();
    host.errors = &want_errors;
    host.dst = want.data();
    CpuBackend cpu;
    ASSERT_TRUE(cpu.GatherBlockRows(host).ok());
    EXPECT_GT(want_errors, 2);

    auto upload = [&](const void* data, size_t n) {
      auto b = (*gpu)->Allocate(n);
      EXPECT_TRUE(b.ok());
      EXPECT_TRUE((*gpu)->CopyToDevice(data, (*b)->data(), n).ok());
      return std::move(*b);
    };
    const int32_t zero = 0;
    std::vector<uint8_t> pattern(dst_bytes, 0xab);
    auto d_tables = upload(tables.data(), tables.size() * 4);
    auto d_slots = upload(slots.data(), slots.size() * 4);
    auto d_counts = upload(counts.data(), counts.size() * 4);
    auto d_errors = upload(&zero, 4);
    auto d_dst = upload(pattern.data(), dst_bytes);
    BlockRowsGather dev = g;
    dev.tables = static_cast<const int32_t*>(d_tables->data());
    dev.slots = static_cast<const int32_t*>(d_slots->data());
    dev.counts = static_cast<const int32_t*>(d_counts->data());
    dev.errors = static_cast<int32_t*>(d_errors->data());
    dev.dst = d_dst->data();
    const BackendCounters before = (*gpu)->counters();
    ASSERT_TRUE((*gpu)->GatherBlockRows(dev).ok());
    const BackendCounters used = (*gpu)->counters() - before;
    EXPECT_EQ(
        used.synchronizations + used.copies_to_host + used.copies_to_device + used.allocations, 0)
        << "queued: no wait, no copy, no allocation";
    std::vector<uint8_t> got(dst_bytes);
    int32_t errors = -1;
    ASSERT_TRUE((*gpu)->CopyToHost(d_dst->data(), got.data(), dst_bytes).ok());
    ASSERT_TRUE((*gpu)->CopyToHost(d_errors->data(), &errors, 4).ok());
    EXPECT_EQ(errors, want_errors);
    for (int64_t r = 0; r < lists * kDstRows; ++r) {
      ASSERT_EQ(std::memcmp(got.data() + r * layout.row_bytes, want.data() + r * layout.row_bytes,
                            static_cast<size_t>(layout.row_bytes)),
                0)
          << "list " << r / kDstRows << " row " << r % kDstRows;
    }

    // The same on the side queue: forked after the pattern is written again, joined before the
    // copy out (an enqueued order only: no wait).
    std::vector<uint8_t> side_got(dst_bytes);
    ASSERT_TRUE((*gpu)->CopyToDevice(pattern.data(), d_dst->data(), dst_bytes).ok());
    ASSERT_TRUE((*gpu)->CopyToDevice(&zero, d_errors->data(), 4).ok());
    BlockRowsGather side = dev;
    side.on_side_queue = true;
    const BackendCounters side_before = (*gpu)->counters();
    ASSERT_TRUE((*gpu)->ForkSideQueue().ok());
    ASSERT_TRUE((*gpu)->GatherBlockRows(side).ok());
    ASSERT_TRUE((*gpu)->JoinSideQueue().ok());
    const BackendCounters side_used = (*gpu)->counters() - side_before;
    EXPECT_EQ(side_used.synchronizations + side_used.copies_to_host + side_used.copies_to_device +
                  side_used.allocations,
              0);
    ASSERT_TRUE((*gpu)->CopyToHost(d_dst->data(), side_got.data(), dst_bytes).ok());
    ASSERT_TRUE((*gpu)->CopyToHost(d_errors->data(), &errors, 4).ok());
    EXPECT_EQ(errors, want_errors);
    EXPECT_EQ(side_got, want) << "the side queue's gather, joined";

    // With dst_rows (row reuse: each row where it is free): reversed within each list, two
    // outside the list's rows (counted, not written).
    std::vector<int32_t> rows(slots.size());
    for (int64_t l = 0; l < lists; ++l) {
      for (int64_t j = 0; j < kSlots; ++j)
        rows[l * kSlots + j] = static_cast<int32_t>(kMax - 1 - j);
    }
    rows[7] = static_cast<int32_t>(kDstRows);
    rows[kSlots + 1] = -1;
    std::vector<uint8_t> placed_want(dst_bytes, 0xab);
    int32_t placed_errors = 0;
    BlockRowsGather placed_host = host;
    placed_host.dst = placed_want.data();
    placed_host.errors = &placed_errors;
    placed_host.dst_rows = rows.data();
    ASSERT_TRUE(cpu.GatherBlockRows(placed_host).ok());
    auto d_rows = upload(rows.data(), rows.size() * 4);
    ASSERT_TRUE((*gpu)->CopyToDevice(pattern.data(), d_dst->data(), dst_bytes).ok());
    ASSERT_TRUE((*gpu)->CopyToDevice(&zero, d_errors->data(), 4).ok());
    BlockRowsGather placed = dev;
    placed.dst_rows = static_cast<const int32_t*>(d_rows->data());
    ASSERT_TRUE((*gpu)->GatherBlockRows(placed).ok());
    ASSERT_TRUE((*gpu)->CopyToHost(d_dst->data(), side_got.data(), dst_bytes).ok());
    ASSERT_TRUE((*gpu)->CopyToHost(d_errors->data(), &errors, 4).ok());
    EXPECT_EQ(errors, placed_errors);
    EXPECT_EQ(side_got, placed_want) << "rows placed by dst_rows";

    // A count per list (what KeptRowsPlan and KeptRowsMap list to move), with dst_rows: counts
    // in range, 0, negative and past max_count (taken as max_count, counted once per list).
    std::vector<int32_t> list_counts(static_cast<size_t>(lists));
    for (int64_t l = 0; l < lists; ++l) list_counts[l] = static_cast<int32_t>(rng() % kMax);
    list_counts[1] = 0;
    list_counts[2] = -4;
    list_counts[3] = static_cast<int32_t>(kMax + 9);
    list_counts[lists - 1] = static_cast<int32_t>(kMax);
    std::vector<uint8_t> listed_want(dst_bytes, 0xab);
    int32_t listed_errors = 0;
    BlockRowsGather listed_host = placed_host;
    listed_host.dst = listed_want.data();
    listed_host.errors = &listed_errors;
    listed_host.list_counts = list_counts.data();
    ASSERT_TRUE(cpu.GatherBlockRows(listed_host).ok());
    auto d_list_counts = upload(list_counts.data(), list_counts.size() * 4);
    ASSERT_TRUE((*gpu)->CopyToDevice(pattern.data(), d_dst->data(), dst_bytes).ok());
    ASSERT_TRUE((*gpu)->CopyToDevice(&zero, d_errors->data(), 4).ok());
    BlockRowsGather listed = placed;
    listed.list_counts = static_cast<const int32_t*>(d_list_counts->data());
    ASSERT_TRUE((*gpu)->GatherBlockRows(listed).ok());
    ASSERT_TRUE((*gpu)->CopyToHost(d_dst->data(), side_got.data(), dst_bytes).ok());
    ASSERT_TRUE((*gpu)->CopyToHost(d_errors->data(), &errors, 4).ok());
    EXPECT_EQ(errors, listed_errors);
    EXPECT_NE(listed_want, placed_want) << "the lists' own counts gather other rows";
    EXPECT_EQ(side_got, listed_want) << "rows gathered by each list's count";
    d_list_counts.reset();
    d_rows.reset();

    std::vector<uint8_t> elsewhere(arena_bytes);
    BlockRowsGather outside = dev;
    outside.arena = elsewhere.data();
    EXPECT_EQ((*gpu)->GatherBlockRows(outside).code(), absl::StatusCode::kInvalidArgument);
    d_tables.reset();
    d_slots.reset();
    d_counts.reset();
    d_errors.reset();
    d_dst.reset();
    gpu->reset();  // unregisters before the mapping goes
    ::munmap(map, arena_bytes);
  }
}

TEST(CudaBackend, WithoutADeviceCreateFailsCleanly) {
  auto backend = CudaBackend::Create({/*device=*/cuda::DeviceCount() + 3, DType::kBF16});
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
}

// INFINIGEN_CUDA_CAUSAL picks the prefill's attention; a value it does not know is refused with
// what to set instead, before any device is touched (so this runs without a GPU too).
TEST(CudaBackend, AnUnknownCausalPathIsRefused) {
  const char* was = std::getenv("INFINIGEN_CUDA_CAUSAL");
  const std::string saved = was != nullptr ? was : "";
  setenv("INFINIGEN_CUDA_CAUSAL", "flash", 1);
  auto backend = CudaBackend::Create({0, DType::kBF16});
  if (was != nullptr) {
    setenv("INFINIGEN_CUDA_CAUSAL", saved.c_str(), 1);
  } else {
    unsetenv("INFINIGEN_CUDA_CAUSAL");
  }
  ASSERT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(backend.status().message().find("use gemm or tiles"), std::string::npos)
      << backend.status();
}

}  // namespace
}  // namespace infinigen
