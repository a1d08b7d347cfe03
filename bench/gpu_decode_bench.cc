// GPU decode benchmark: Llama-3.1-8B-shaped layers (random bf16 weights: no weights can be
// downloaded for it), the whole KV cache in pinned host memory, three ways to attend:
//   infinigen  speculation of layer l+1 during layer l (partial query . partial key cache on the
//              GPU, budget from the alpha threshold, top-k), the selected rows gathered from host
//              memory by a kernel on a second stream; layer 0 is fetched in full (no predecessor)
//   full       every row of every layer copied host -> GPU each step (FlexGen-style), the next
//              layer's copy overlapping the current layer
//   resident   all K/V in GPU memory (where it fits)
// plus the measured pinned host->device and HBM bandwidth and the gather kernel against a
// CPU-gather + cudaMemcpyAsync variant. Prints a markdown table last.
//
//   gpu_decode_bench [--layers=32] [--contexts=8192,32768] [--batches=1,8,16] [--budget=0.2]
//                    [--alpha=4] [--steps=4] [--modes=infinigen,full,resident] [--graphs]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gpu_worker/backend/cuda_backend.h"
#include "kernels/cuda/ops.h"

namespace infinigen {
namespace {

constexpr int kHidden = 4096, kHeads = 32, kKvHeads = 8, kHeadDim = 128, kInter = 14336;
constexpr int kVocab = 128256, kQkv = kHidden + 2 * kKvHeads * kHeadDim;
constexpr int64_t kRowBytes = kHeadDim * 2;  // one K or V row of one head, bf16

#define CK(expr)                                                                                 \
  do {                                                                                           \
    cudaError_t e_ = (expr);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)
#define OK(expr)                                                                     \
  do {                                                                               \
    absl::Status s_ = (expr);                                                        \
    if (!s_.ok()) {                                                                  \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

class ViewBuffer final : public Buffer {
 public:
  ViewBuffer(void* data, size_t size) : data_(data), size_(size) {}
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  void* data_;
  size_t size_;
};

struct Options {
  int layers = 32;
  std::vector<int64_t> contexts = {8192, 32768};
  std::vector<int64_t> batches = {1, 8, 16};
  std::vector<std::string> modes = {"infinigen", "full", "resident"};
  float budget = 0.2f, alpha = 4.0f, partial_ratio = 0.2f;
  int steps = 4;
  bool graphs = false;
};

std::vector<int64_t> Ints(const std::string& s) {
  std::vector<int64_t> v;
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int64_t x;
    if (absl::SimpleAtoi(p, &x)) v.push_back(x);
  }
  return v;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Layer {
  Weight qkv, o, up, down, attn_norm, mlp_norm;
  Weight spec_q;         // view of qkv's first kHidden rows: the speculated query's projection
  void* skew = nullptr;  // f32 [kv_heads, head_dim, partial_dim]
};

class Bench {
 public:
  explicit Bench(const Options& o)
      : o_(o), p_(static_cast<int>(std::ceil(o.partial_ratio * kHeadDim))) {
    auto main = CudaBackend::Create({0, DType::kBF16});
    auto side = CudaBackend::Create({0, DType::kBF16});
    OK(main.status());
    OK(side.status());
    main_ = std::move(*main);
    side_ = std::move(*side);
    ms_ = static_cast<cudaStream_t>(main_->stream());
    ss_ = static_cast<cudaStream_t>(side_->stream());
    max_batch_ = *std::max_element(o.batches.begin(), o.batches.end());
    cap_ = *std::max_element(o.contexts.begin(), o.contexts.end()) + 64;
  }

  void* Dev(size_t bytes) {
    auto b = main_->Allocate(bytes);
    OK(b.status());
    void* p = (*b)->data();
    owned_.push_back(std::move(*b));
    return p;
  }
  Weight RandomWeight(int64_t rows, int64_t cols, uint64_t seed) {
    Weight w;
    w.rows = rows, w.cols = cols, w.format = rows == 1 ? WeightFormat::kF32 : WeightFormat::kBF16;
    const cuda::Elem t = rows == 1 ? cuda::Elem::kF32 : cuda::Elem::kBF16;
    auto b = main_->Allocate(rows * cols * cuda::ElemSize(t));
    OK(b.status());
    w.buffer = std::move(*b);
    // Uniform with variance 1/cols keeps activations O(1); norm weights around 1.
    CK(cuda::FillRandom(w.buffer->data(), t, rows * cols, seed,
                        rows == 1 ? 1.0f : std::sqrt(3.0f / cols), ms_));
    return w;
  }

  void Setup() {
    const double t0 = Now();
    for (int l = 0; l < o_.layers; ++l) {
      Layer L;
      L.qkv = RandomWeight(kQkv, kHidden, 100 + l);
      L.o = RandomWeight(kHidden, kHidden, 200 + l);
      L.up = RandomWeight(2 * kInter, kHidden, 300 + l);
      L.down = RandomWeight(kHidden, kInter, 400 + l);
      L.attn_norm = RandomWeight(1, kHidden, 500 + l);
      L.mlp_norm = RandomWeight(1, kHidden, 600 + l);
      L.spec_q.buffer = std::make_unique<ViewBuffer>(L.qkv.buffer->data(), kHidden * kHidden * 2);
      L.spec_q.rows = kHidden, L.spec_q.cols = kHidden, L.spec_q.format = WeightFormat::kBF16;
      L.skew = Dev(kKvHeads * kHeadDim * p_ * 4);
      CK(cuda::FillRandom(L.skew, cuda::Elem::kF32, kKvHeads * kHeadDim * p_, 700 + l, 0.15f, ms_));
      layers_.push_back(std::move(L));
    }
    final_norm_ = RandomWeight(1, kHidden, 800);
    lm_head_ = RandomWeight(kVocab, kHidden, 801);
    std::vector<float> inv(kHeadDim / 2);
    for (int i = 0; i < kHeadDim / 2; ++i) inv[i] = std::pow(500000.0f, -2.0f * i / kHeadDim);
    inv_freq_ = static_cast<float*>(Dev(inv.size() * 4));
    OK(main_->CopyToDevice(inv.data(), inv_freq_, inv.size() * 4));
    const int64_t b = max_batch_;
    x_ = Dev(b * kHidden * 2);
    h_[0] = Dev(b * kHidden * 2), h_[1] = Dev(b * kHidden * 2);
    qkv_ = Dev(b * kQkv * 2);
    spec_ = Dev(b * kHidden * 2);
    attn_ = Dev(b * kHidden * 2);
    mlp_ = Dev(b * 2 * kInter * 2);
    act_ = Dev(b * kInter * 2);
    logits_ = Dev(b * kVocab * 4);
    tokens_ = static_cast<int32_t*>(Dev(b * 4));
    positions_ = static_cast<int32_t*>(Dev(b * 4));
    rows_ = static_cast<int32_t*>(Dev(b * 4));
    q_partial_ = static_cast<float*>(Dev(b * kHeads * p_ * 4));
    kmax_cap_ = cuda::SpeculationMaxBudget(o_.budget, cap_);
    for (int i = 0; i < 2; ++i) {
      counts_[i] = static_cast<int32_t*>(Dev(b * 4));
      sel_k_[i] = Dev(b * kKvHeads * kmax_cap_ * kRowBytes);
      sel_v_[i] = Dev(b * kKvHeads * kmax_cap_ * kRowBytes);
      full_k_[i] = Dev(b * kKvHeads * cap_ * kRowBytes);
      full_v_[i] = Dev(b * kKvHeads * cap_ * kRowBytes);
    }
    indices_ = static_cast<int32_t*>(Dev(b * kKvHeads * kmax_cap_ * 4));
    partial_keys_ = Dev(b * o_.layers * kKvHeads * cap_ * p_ * 2);
    CK(cuda::FillRandom(partial_keys_, cuda::Elem::kBF16, b * o_.layers * kKvHeads * cap_ * p_, 900,
                        1.0f, ms_));
    size_t attn_ws = 0;  // the split count depends on the batch: the largest over the batches
    for (int64_t batch : o_.batches) {
      cuda::DecodeAttention a = DecodeShape(batch);
      a.max_rows = static_cast<int32_t>(cap_);
      attn_ws = std::max(attn_ws, cuda::DecodeAttentionWorkspaceBytes(a));
    }
    attn_ws_ = Dev(attn_ws);
    cuda::Speculation s;
    s.batch = static_cast<int>(b), s.num_heads = kHeads, s.num_kv_heads = kKvHeads;
    s.max_rows = static_cast<int32_t>(cap_);
    spec_ws_ = Dev(cuda::SpeculationWorkspaceBytes(s));
    // The host KV cache: [seq][layer][K, V][kv head][cap][head_dim] bf16, pinned and mapped.
    host_bytes_ = static_cast<size_t>(b) * o_.layers * 2 * kKvHeads * cap_ * kRowBytes;
    const double th = Now();
    CK(cudaHostAlloc(&host_kv_, host_bytes_, cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer(&host_kv_dev_, host_kv_, 0));
    CK(cuda::FillRandom(host_kv_dev_, cuda::Elem::kBF16, host_bytes_ / 2, 1000, 1.0f, ms_));
    CK(cudaStreamSynchronize(ms_));
    std::printf(
        "setup: %d layers, %.1f GiB pinned host KV (%.1f s to pin and fill), %.1f s total\n",
        o_.layers, host_bytes_ / 1073741824.0, Now() - th, Now() - t0);
    for (auto& e : ev_h_) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    for (auto& e : ev_g_) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&ev_join_, cudaEventDisableTiming));
  }

  int64_t SeqStride() const {
    return static_cast<int64_t>(o_.layers) * 2 * kKvHeads * cap_ * kHeadDim;
  }
  int64_t LayerStride() const { return 2 * kKvHeads * cap_ * kHeadDim; }

  cuda::DecodeAttention DecodeShape(int64_t batch) const {
    cuda::DecodeAttention a;
    a.type = cuda::Elem::kBF16;
    a.batch = static_cast<int>(batch), a.num_heads = kHeads, a.num_kv_heads = kKvHeads;
    a.head_dim = kHeadDim, a.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
    a.q = qkv_, a.q_seq_stride = kQkv;
    a.k_cur = static_cast<uint16_t*>(qkv_) + kHidden;
    a.v_cur = static_cast<uint16_t*>(qkv_) + kHidden + kKvHeads * kHeadDim;
    a.cur_seq_stride = kQkv;
    a.out = attn_, a.out_seq_stride = kHidden;
    return a;
  }

  cuda::Mat M(void* p, int64_t rows, int64_t cols, int64_t stride = 0) const {
    return {p, cuda::Elem::kBF16, rows, cols, stride ? stride : cols};
  }
  MatView V(void* p, int64_t rows, int64_t cols, int64_t stride = 0, DType t = DType::kBF16) const {
    return {p, t, rows, cols, stride ? stride : cols};
  }

  // Full copy of layer l's n rows per head for every sequence into full_[slot] on `stream`.
  void FetchFull(int l, int slot, int64_t batch, int64_t n, cudaStream_t stream) {
    const auto* host = static_cast<const uint8_t*>(host_kv_);
    for (int64_t b = 0; b < batch; ++b) {
      for (int kv = 0; kv < 2; ++kv) {
        const uint8_t* src =
            host + (b * SeqStride() + l * LayerStride() + kv * kKvHeads * cap_ * kHeadDim) * 2;
        uint8_t* dst = static_cast<uint8_t*>(kv == 0 ? full_k_[slot] : full_v_[slot]) +
                       b * kKvHeads * n * kRowBytes;
        CK(cudaMemcpy2DAsync(dst, n * kRowBytes, src, cap_ * kRowBytes, n * kRowBytes, kKvHeads,
                             cudaMemcpyHostToDevice, stream));
      }
    }
  }

  // Speculation of layer l from h (layer l-1's attention input) and the gather of its rows.
  void SpeculateAndGather(int l, const void* h, int64_t batch, int64_t n) {
    const Layer& L = layers_[l];
    OK(side_->Linear(V(const_cast<void*>(h), batch, kHidden), L.spec_q, nullptr,
                     V(spec_, batch, kHidden), false));
    CK(cuda::Rope(M(spec_, batch, kHidden), kHeads, kHeadDim, kHeadDim, positions_, inv_freq_,
                  false, ss_));
    cuda::PartialProjection pp;
    pp.x_type = cuda::Elem::kBF16, pp.x = spec_, pp.x_seq_stride = kHidden;
    pp.batch = static_cast<int>(batch), pp.num_heads = kHeads, pp.num_kv_heads = kKvHeads;
    pp.head_dim = kHeadDim, pp.partial_dim = p_, pp.skew = static_cast<float*>(L.skew);
    pp.out = q_partial_, pp.out_seq_stride = kHeads * p_, pp.out_head_stride = p_;
    CK(cuda::RunPartialProjection(pp, ss_));
    cuda::Speculation s;
    s.batch = static_cast<int>(batch), s.num_heads = kHeads, s.num_kv_heads = kKvHeads;
    s.partial_dim = p_, s.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
    s.q_partial = q_partial_, s.key_type = cuda::Elem::kBF16;
    s.keys = static_cast<uint16_t*>(partial_keys_) + static_cast<int64_t>(l) * kKvHeads * cap_ * p_;
    s.key_seq_stride = static_cast<int64_t>(o_.layers) * kKvHeads * cap_ * p_;
    s.key_head_stride = cap_ * p_;
    s.num_rows = rows_, s.max_rows = static_cast<int32_t>(n);
    s.alpha = o_.alpha, s.budget_fraction = o_.budget, s.k_min = 1;
    s.indices = indices_, s.index_capacity = kmax_cap_, s.counts = counts_[l % 2];
    s.workspace = spec_ws_;
    CK(cuda::RunSpeculation(s, ss_));
    for (int kv = 0; kv < 2; ++kv) {
      cuda::Gather g;
      g.batch = static_cast<int>(batch), g.num_kv_heads = kKvHeads, g.row_bytes = kRowBytes;
      g.src = static_cast<const uint8_t*>(host_kv_dev_) +
              (l * LayerStride() + kv * kKvHeads * cap_ * kHeadDim) * 2;
      g.src_seq_stride = SeqStride() * 2, g.src_head_stride = cap_ * kRowBytes;
      g.indices = indices_, g.index_capacity = kmax_cap_, g.counts = counts_[l % 2];
      g.max_count = cuda::SpeculationMaxBudget(o_.budget, n);
      g.dst = kv == 0 ? sel_k_[l % 2] : sel_v_[l % 2];
      g.dst_rows_per_head = kmax_cap_;
      CK(cuda::RunGather(g, ss_));
    }
  }

  // One decode step of `batch` sequences holding n tokens each; returns seconds. With
  // --graphs the step's work on both streams is captured once into a CUDA graph and replayed.
  double Step(const std::string& mode, int64_t batch, int64_t n) {
    if (!o_.graphs) {
      const double t0 = Now();
      Enqueue(mode, batch, n);
      CK(cudaStreamSynchronize(ss_));
      CK(cudaStreamSynchronize(ms_));
      return Now() - t0;
    }
    if (graph_exec_ == nullptr) {
      cudaGraph_t graph = nullptr;
      CK(cudaStreamBeginCapture(ms_, cudaStreamCaptureModeThreadLocal));
      CK(cudaEventRecord(ev_fork_, ms_));
      CK(cudaStreamWaitEvent(ss_, ev_fork_));  // the side stream joins the capture
      Enqueue(mode, batch, n);
      CK(cudaEventRecord(ev_join_, ss_));
      CK(cudaStreamWaitEvent(ms_, ev_join_));
      CK(cudaStreamEndCapture(ms_, &graph));
      CK(cudaGraphInstantiate(&graph_exec_, graph, 0));
      CK(cudaGraphDestroy(graph));
    }
    const double t0 = Now();
    CK(cudaGraphLaunch(graph_exec_, ms_));
    CK(cudaStreamSynchronize(ms_));
    return Now() - t0;
  }

  void Enqueue(const std::string& mode, int64_t batch, int64_t n) {
    const bool infinigen = mode == "infinigen", full = mode == "full";
    if (full || infinigen) FetchFull(0, 0, batch, n, ss_);
    CK(cudaEventRecord(ev_g_[0], ss_));
    if (full) {
      FetchFull(1, 1, batch, n, ss_);
      CK(cudaEventRecord(ev_g_[1], ss_));
    }
    for (int l = 0; l < o_.layers; ++l) {
      const Layer& L = layers_[l];
      void* h = h_[l % 2];
      OK(main_->RmsNorm(V(x_, batch, kHidden), L.attn_norm, 1e-5f, V(h, batch, kHidden)));
      CK(cudaEventRecord(ev_h_[l % 2], ms_));
      if (l + 1 < o_.layers && (infinigen || (full && l >= 1))) {
        // The side stream works on layer l+1 while this layer computes.
        CK(cudaStreamWaitEvent(ss_, ev_h_[l % 2]));
        if (infinigen) {
          SpeculateAndGather(l + 1, h, batch, n);
        } else {  // layer l+1's slot held layer l-1, whose attention is done
          FetchFull(l + 1, (l + 1) % 2, batch, n, ss_);
        }
        CK(cudaEventRecord(ev_g_[(l + 1) % 2], ss_));
      }
      OK(main_->Linear(V(h, batch, kHidden), L.qkv, nullptr, V(qkv_, batch, kQkv), false));
      CK(cuda::Rope(M(qkv_, batch, kHidden + kKvHeads * kHeadDim, kQkv), kHeads + kKvHeads,
                    kHeadDim, kHeadDim, positions_, inv_freq_, false, ms_));
      cuda::DecodeAttention a = DecodeShape(batch);
      a.workspace = attn_ws_;
      const auto* k_cur = static_cast<const uint8_t*>(a.k_cur);
      if (mode == "resident") {
        const auto* base = static_cast<uint16_t*>(resident_) + l * LayerStride();
        a.k = base, a.v = base + kKvHeads * cap_ * kHeadDim;
        a.kv_seq_stride = SeqStride(), a.head_stride = cap_ * kHeadDim, a.row_stride = kHeadDim;
        a.num_rows = static_cast<int32_t>(n);
        CK(cuda::ScatterRows(k_cur, kQkv * 2, static_cast<int>(batch), kKvHeads, kRowBytes, rows_,
                             const_cast<uint16_t*>(base), SeqStride() * 2, cap_ * kRowBytes, ms_));
      } else {
        // Append the new rows to the host cache (and the partial key cache) through the mapping.
        auto* base = static_cast<uint16_t*>(host_kv_dev_) + l * LayerStride();
        CK(cuda::ScatterRows(k_cur, kQkv * 2, static_cast<int>(batch), kKvHeads, kRowBytes, rows_,
                             base, SeqStride() * 2, cap_ * kRowBytes, ms_));
        CK(cuda::ScatterRows(k_cur + kKvHeads * kRowBytes, kQkv * 2, static_cast<int>(batch),
                             kKvHeads, kRowBytes, rows_, base + kKvHeads * cap_ * kHeadDim,
                             SeqStride() * 2, cap_ * kRowBytes, ms_));
        if (infinigen) {
          cuda::PartialProjection pk;
          pk.x_type = cuda::Elem::kBF16, pk.x = k_cur, pk.x_seq_stride = kQkv;
          pk.batch = static_cast<int>(batch), pk.num_heads = kKvHeads, pk.num_kv_heads = kKvHeads;
          pk.head_dim = kHeadDim, pk.partial_dim = p_, pk.skew = static_cast<float*>(L.skew);
          pk.out_type = cuda::Elem::kBF16;
          pk.out = static_cast<uint16_t*>(partial_keys_) +
                   (static_cast<int64_t>(l) * kKvHeads * cap_ + n) * p_;
          pk.out_seq_stride = static_cast<int64_t>(o_.layers) * kKvHeads * cap_ * p_;
          pk.out_head_stride = cap_ * p_;
          CK(cuda::RunPartialProjection(pk, ms_));
        }
        CK(cudaStreamWaitEvent(ms_, ev_g_[l % 2]));
        if (infinigen && l > 0) {
          a.k = sel_k_[l % 2], a.v = sel_v_[l % 2];
          a.kv_seq_stride = kKvHeads * kmax_cap_ * kHeadDim, a.head_stride = kmax_cap_ * kHeadDim;
          a.row_stride = kHeadDim;
          a.num_rows_per_seq = counts_[l % 2];
          a.max_rows = static_cast<int32_t>(cuda::SpeculationMaxBudget(o_.budget, n));
        } else {
          const int slot = infinigen ? 0 : l % 2;
          a.k = full_k_[slot], a.v = full_v_[slot];
          a.kv_seq_stride = kKvHeads * n * kHeadDim, a.head_stride = n * kHeadDim,
          a.row_stride = kHeadDim;
          a.num_rows = static_cast<int32_t>(n);
        }
      }
      CK(cuda::RunDecodeAttention(a, ms_));
      OK(main_->Linear(V(attn_, batch, kHidden), L.o, nullptr, V(x_, batch, kHidden), true));
      // The MLP's input goes to attn_ (free after the output projection): h may still be read
      // by the side stream's speculation.
      OK(main_->RmsNorm(V(x_, batch, kHidden), L.mlp_norm, 1e-5f, V(attn_, batch, kHidden)));
      OK(main_->Linear(V(attn_, batch, kHidden), L.up, nullptr, V(mlp_, batch, 2 * kInter), false));
      OK(main_->SwiGlu(V(mlp_, batch, kInter, 2 * kInter),
                       V(static_cast<uint16_t*>(mlp_) + kInter, batch, kInter, 2 * kInter),
                       V(act_, batch, kInter)));
      OK(main_->Linear(V(act_, batch, kInter), L.down, nullptr, V(x_, batch, kHidden), true));
    }
    OK(main_->RmsNorm(V(x_, batch, kHidden), final_norm_, 1e-5f, V(h_[0], batch, kHidden)));
    OK(main_->Linear(V(h_[0], batch, kHidden), lm_head_, nullptr,
                     V(logits_, batch, kVocab, 0, DType::kF32), false));
    CK(cuda::Argmax(static_cast<float*>(logits_), batch, kVocab, tokens_, ms_));
  }

  struct Result {
    std::string mode;
    int64_t context, batch;
    double seconds_per_step = 0, tokens_per_s = 0, gib_per_step = 0, selected_fraction = 0;
    bool skipped = false;
    std::string note;
  };

  Result Run(const std::string& mode, int64_t batch, int64_t n) {
    Result r{mode, n, batch};
    const size_t resident_bytes = static_cast<size_t>(batch) * SeqStride() * 2;
    if (mode == "resident") {
      size_t free = 0, total = 0;
      CK(cudaMemGetInfo(&free, &total));
      // Resident K/V with this process's stride (cap rows per head).
      if (resident_bytes + (size_t{1} << 30) > free) {
        r.skipped = true;
        r.note = "does not fit: " + std::to_string(resident_bytes >> 30) + " GiB of K/V";
        return r;
      }
      auto b = main_->Allocate(resident_bytes);
      OK(b.status());
      resident_buf_ = std::move(*b);
      resident_ = resident_buf_->data();
      CK(cuda::FillRandom(resident_, cuda::Elem::kBF16, resident_bytes / 2, 1100, 1.0f, ms_));
    }
    std::vector<int32_t> pos(batch, static_cast<int32_t>(n));
    OK(main_->CopyToDevice(pos.data(), positions_, batch * 4));
    OK(main_->CopyToDevice(pos.data(), rows_, batch * 4));
    CK(cuda::FillRandom(x_, cuda::Elem::kBF16, batch * kHidden, 1200, 1.0f, ms_));
    Enqueue(mode, batch, n);  // warm-up outside any graph (cuBLAS heuristics, first touch)
    CK(cudaStreamSynchronize(ss_));
    CK(cudaStreamSynchronize(ms_));
    Step(mode, batch, n);  // with --graphs: captures the step
    std::vector<double> times;
    for (int s = 0; s < o_.steps; ++s) times.push_back(Step(mode, batch, n));
    if (graph_exec_ != nullptr) {
      CK(cudaGraphExecDestroy(graph_exec_));
      graph_exec_ = nullptr;
    }
    std::sort(times.begin(), times.end());
    r.seconds_per_step = times[times.size() / 2];
    r.tokens_per_s = batch / r.seconds_per_step;
    const double per_token_layer = 2.0 * kKvHeads * kRowBytes;  // K and V of one token, one layer
    if (mode == "full") r.gib_per_step = batch * n * per_token_layer * o_.layers / 1073741824.0;
    if (mode == "infinigen") {
      std::vector<int32_t> c(batch);
      double sel = 0;
      for (int i = 0; i < 2; ++i) {
        OK(main_->CopyToHost(counts_[i], c.data(), batch * 4));
        sel += std::accumulate(c.begin(), c.end(), 0.0);
      }
      const double rows_per_seq_layer = sel / (2.0 * batch);  // mean over the last two layers
      r.selected_fraction = rows_per_seq_layer / n;
      r.gib_per_step =
          batch * (n + rows_per_seq_layer * (o_.layers - 1)) * per_token_layer / 1073741824.0;
    }
    resident_buf_.reset();
    resident_ = nullptr;
    return r;
  }

  // Pinned host->device copy bandwidth and HBM copy bandwidth (bytes read + written).
  void Bandwidths(double& h2d, double& hbm) {
    const size_t bytes = size_t{1} << 30;
    void* dst = Dev(2 * bytes);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    float ms = 0;
    auto time = [&](auto fn) {
      fn();
      CK(cudaEventRecord(a, ms_));
      for (int i = 0; i < 5; ++i) fn();
      CK(cudaEventRecord(b, ms_));
      CK(cudaEventSynchronize(b));
      CK(cudaEventElapsedTime(&ms, a, b));
      return ms / 5 / 1000.0;
    };
    h2d = bytes /
          time([&] { CK(cudaMemcpyAsync(dst, host_kv_, bytes, cudaMemcpyHostToDevice, ms_)); }) /
          1e9;
    hbm = 2.0 * bytes / time([&] {
            CK(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + bytes, dst, bytes,
                               cudaMemcpyDeviceToDevice, ms_));
          }) /
          1e9;
  }

  // The gather of `fraction` of n rows per head for `batch` sequences (one layer, K and V): the
  // kernel reading mapped host memory vs CPU threads packing pinned staging + one async copy.
  void GatherVariants(int64_t batch, int64_t n, double& kernel_gbs, double& staged_gbs) {
    const int64_t k = cuda::SpeculationMaxBudget(o_.budget, n);
    std::vector<int32_t> idx(batch * kKvHeads * kmax_cap_);
    std::mt19937 rng(7);
    std::vector<int32_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    for (int64_t list = 0; list < batch * kKvHeads; ++list) {
      std::shuffle(all.begin(), all.end(), rng);
      std::sort(all.begin(), all.begin() + k);
      std::copy_n(all.begin(), k, idx.begin() + list * kmax_cap_);
    }
    OK(main_->CopyToDevice(idx.data(), indices_, idx.size() * 4));
    const double bytes = 2.0 * batch * kKvHeads * k * kRowBytes;
    auto kernel = [&] {
      for (int kv = 0; kv < 2; ++kv) {
        cuda::Gather g;
        g.batch = static_cast<int>(batch), g.num_kv_heads = kKvHeads, g.row_bytes = kRowBytes;
        g.src = static_cast<const uint8_t*>(host_kv_dev_) + kv * kKvHeads * cap_ * kRowBytes;
        g.src_seq_stride = SeqStride() * 2, g.src_head_stride = cap_ * kRowBytes;
        g.indices = indices_, g.index_capacity = kmax_cap_, g.count = k;
        g.dst = kv == 0 ? sel_k_[0] : sel_v_[0], g.dst_rows_per_head = kmax_cap_;
        CK(cuda::RunGather(g, ms_));
      }
      CK(cudaStreamSynchronize(ms_));
    };
    kernel();
    double t0 = Now();
    for (int i = 0; i < 5; ++i) kernel();
    kernel_gbs = bytes * 5 / (Now() - t0) / 1e9;

    void* staging = nullptr;
    CK(cudaHostAlloc(&staging, static_cast<size_t>(bytes), cudaHostAllocDefault));
    const int threads = std::max(1u, std::thread::hardware_concurrency());
    auto staged = [&] {
      std::vector<std::thread> pool;
      const int64_t lists = 2 * batch * kKvHeads;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          for (int64_t list = t; list < lists; list += threads) {
            const int kv = static_cast<int>(list / (batch * kKvHeads));
            const int64_t bl = list % (batch * kKvHeads), b = bl / kKvHeads, g = bl % kKvHeads;
            const auto* src = static_cast<const uint8_t*>(host_kv_) +
                              (b * SeqStride() + kv * kKvHeads * cap_ * kHeadDim) * 2 +
                              g * cap_ * kRowBytes;
            auto* dst = static_cast<uint8_t*>(staging) + list * k * kRowBytes;
            const int32_t* rows = idx.data() + bl * kmax_cap_;
            for (int64_t j = 0; j < k; ++j)
              std::memcpy(dst + j * kRowBytes, src + rows[j] * kRowBytes, kRowBytes);
          }
        });
      }
      for (auto& th : pool) th.join();
      const size_t half = static_cast<size_t>(bytes) / 2;  // K lists, then V lists
      CK(cudaMemcpyAsync(sel_k_[0], staging, half, cudaMemcpyHostToDevice, ms_));
      CK(cudaMemcpyAsync(sel_v_[0], static_cast<uint8_t*>(staging) + half, half,
                         cudaMemcpyHostToDevice, ms_));
      CK(cudaStreamSynchronize(ms_));
    };
    staged();
    t0 = Now();
    for (int i = 0; i < 5; ++i) staged();
    staged_gbs = bytes * 5 / (Now() - t0) / 1e9;
    cudaFreeHost(staging);
  }

  Options o_;
  int p_;
  std::unique_ptr<CudaBackend> main_, side_;
  cudaStream_t ms_ = nullptr, ss_ = nullptr;
  int64_t max_batch_ = 0, cap_ = 0, kmax_cap_ = 0;
  std::vector<std::unique_ptr<Buffer>> owned_;
  std::vector<Layer> layers_;
  Weight final_norm_, lm_head_;
  float* inv_freq_ = nullptr;
  void *x_ = nullptr, *h_[2] = {}, *qkv_ = nullptr, *spec_ = nullptr, *attn_ = nullptr,
       *mlp_ = nullptr, *act_ = nullptr, *logits_ = nullptr;
  int32_t *tokens_ = nullptr, *positions_ = nullptr, *rows_ = nullptr, *indices_ = nullptr;
  int32_t* counts_[2] = {};
  float* q_partial_ = nullptr;
  void *sel_k_[2] = {}, *sel_v_[2] = {}, *full_k_[2] = {}, *full_v_[2] = {};
  void *partial_keys_ = nullptr, *attn_ws_ = nullptr, *spec_ws_ = nullptr;
  void *host_kv_ = nullptr, *host_kv_dev_ = nullptr, *resident_ = nullptr;
  std::unique_ptr<Buffer> resident_buf_;
  size_t host_bytes_ = 0;
  cudaEvent_t ev_h_[2] = {}, ev_g_[2] = {}, ev_fork_ = nullptr, ev_join_ = nullptr;
  cudaGraphExec_t graph_exec_ = nullptr;
};

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    const std::string key = a.substr(0, eq),
                      value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (key == "--layers")
      o.layers = std::stoi(value);
    else if (key == "--contexts")
      o.contexts = Ints(value);
    else if (key == "--batches")
      o.batches = Ints(value);
    else if (key == "--budget")
      o.budget = std::stof(value);
    else if (key == "--alpha")
      o.alpha = std::stof(value);
    else if (key == "--steps")
      o.steps = std::stoi(value);
    else if (key == "--modes")
      o.modes = absl::StrSplit(value, ',');
    else if (key == "--graphs")
      o.graphs = value.empty() || value == "true";
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  if (o.contexts.empty() || o.batches.empty() || o.layers < 2 || o.steps < 1) {
    std::fprintf(stderr, "need --contexts, --batches, --layers >= 2, --steps >= 1\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  Bench bench(o);
  bench.Setup();
  double h2d = 0, hbm = 0;
  bench.Bandwidths(h2d, hbm);
  std::printf(
      "device: %s; pinned host->device %.1f GB/s; HBM copy %.0f GB/s (read + write); "
      "CUDA graphs %s\n",
      prop.name, h2d, hbm, o.graphs ? "on" : "off");
  double kernel_gbs = 0, staged_gbs = 0;
  const int64_t gb = std::min<int64_t>(8, *std::max_element(o.batches.begin(), o.batches.end()));
  bench.GatherVariants(gb, o.contexts.back(), kernel_gbs, staged_gbs);
  std::printf(
      "gather of %.0f%% of %lld rows x %lld sequences: kernel over the mapping %.1f GB/s (%.0f%% "
      "of "
      "host->device), CPU gather + cudaMemcpyAsync %.1f GB/s (%.0f%%)\n",
      o.budget * 100, static_cast<long long>(o.contexts.back()), static_cast<long long>(gb),
      kernel_gbs, 100 * kernel_gbs / h2d, staged_gbs, 100 * staged_gbs / h2d);
  std::vector<Bench::Result> results;
  for (int64_t n : o.contexts) {
    for (int64_t b : o.batches) {
      for (const std::string& m : o.modes) {
        results.push_back(bench.Run(m, b, n));
        const auto& r = results.back();
        std::printf(
            "%s ctx %lld batch %lld: %s\n", m.c_str(), static_cast<long long>(n),
            static_cast<long long>(b),
            r.skipped ? r.note.c_str() : (std::to_string(r.tokens_per_s) + " tok/s").c_str());
        std::fflush(stdout);
      }
    }
  }
  std::printf(
      "\n| context | batch | mode | step ms | tokens/s | GiB over the link per step | rows read | "
      "vs full | vs resident |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  std::map<std::pair<int64_t, int64_t>, std::map<std::string, double>> tps;
  for (const auto& r : results) {
    if (!r.skipped) tps[{r.context, r.batch}][r.mode] = r.tokens_per_s;
  }
  for (const auto& r : results) {
    auto& t = tps[{r.context, r.batch}];
    if (r.skipped) {
      std::printf("| %lld | %lld | %s | - | - | - | - | - | %s |\n",
                  static_cast<long long>(r.context), static_cast<long long>(r.batch),
                  r.mode.c_str(), r.note.c_str());
      continue;
    }
    auto ratio = [&](const char* other) {
      return t.count(other) ? std::to_string(r.tokens_per_s / t[other]).substr(0, 5) + "x"
                            : std::string("-");
    };
    std::printf("| %lld | %lld | %s | %.1f | %.1f | %.2f | %s | %s | %s |\n",
                static_cast<long long>(r.context), static_cast<long long>(r.batch), r.mode.c_str(),
                r.seconds_per_step * 1e3, r.tokens_per_s, r.gib_per_step,
                r.mode == "infinigen"
                    ? (std::to_string(r.selected_fraction * 100).substr(0, 4) + "%").c_str()
                    : (r.mode == "full" ? "100%" : "on GPU"),
                ratio("full").c_str(), ratio("resident").c_str());
  }
  return 0;
}

}  // namespace
}  // namespace infinigen

int main(int argc, char** argv) { return infinigen::Main(argc, argv); }
