// InfiniGen's speculation on the GPU (INFINIGEN.md, decode steps 1-5): partial queries and keys
// through the skew, speculated scores against the partial key cache, the per-sequence budget
// from the alpha threshold, the group attention mass, and the top rows per KV head by a radix
// select (no sort).
#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/topk.cuh"

namespace infinigen::cuda {
namespace {

constexpr int kScoreThreads = 256;
constexpr int kMaxPartialDim = kMaxSpeculationPartialDim;
constexpr int kMaxGroup = kMaxSpeculationGroup;

__global__ void TopKKernel(const float* scores, int64_t n, int64_t k, int32_t* out) {
  BlockTopK(scores + blockIdx.x * n, n, k, out + blockIdx.x * k);
}

template <typename Tx, typename To>
__global__ void PartialProjectionKernel(PartialProjection p) {
  const int h = blockIdx.x, b = blockIdx.y, group = p.num_heads / p.num_kv_heads;
  const Tx* x = static_cast<const Tx*>(p.x) + b * p.x_seq_stride + h * p.head_dim;
  const float* a = p.skew + static_cast<int64_t>(h / group) * p.head_dim * p.partial_dim;
  for (int c = threadIdx.x; c < p.partial_dim; c += blockDim.x) {
    float sum = 0.0f;
    for (int i = 0; i < p.head_dim; ++i) sum += Load(x + i) * a[i * p.partial_dim + c];
    Store(static_cast<To*>(p.out) + b * p.out_seq_stride + h * p.out_head_stride +
              c * p.out_channel_stride,
          sum);
  }
}

// Workspace of RunSpeculation: scores [batch, heads, max_rows], mass [batch, kv_heads,
// max_rows], stats [batch, heads, 3] (max, sum of exp, count over the threshold).
struct SpecLayout {
  float* scores;
  float* mass;
  float* stats;
};
SpecLayout Layout(const Speculation& s) {
  float* base = static_cast<float*>(s.workspace);
  const int64_t rows = s.max_rows;
  SpecLayout l;
  l.scores = base;
  l.mass = l.scores + static_cast<int64_t>(s.batch) * s.num_heads * rows;
  l.stats = l.mass + static_cast<int64_t>(s.batch) * s.num_kv_heads * rows;
  return l;
}

__device__ __forceinline__ int64_t NumRows(const Speculation& s, int b) {
  return s.num_rows != nullptr ? s.num_rows[b] : s.max_rows;
}

template <typename Tk>
__global__ void ScoreKernel(Speculation s, SpecLayout l) {
  __shared__ float qs[kMaxGroup * kMaxPartialDim];
  const int g = blockIdx.y, b = blockIdx.z, group = s.num_heads / s.num_kv_heads;
  const int p = s.partial_dim;
  for (int t = threadIdx.x; t < group * p; t += blockDim.x) {
    qs[t] = s.q_partial[(static_cast<int64_t>(b) * s.num_heads + g * group) * p + t];
  }
  __syncthreads();
  const int64_t n = NumRows(s, b);
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int64_t row_stride = s.key_row_stride != 0 ? s.key_row_stride : p;
  const Tk* key = static_cast<const Tk*>(s.keys) + b * s.key_seq_stride + g * s.key_head_stride +
                  j * row_stride;
  float dots[kMaxGroup] = {};
  for (int c = 0; c < p; ++c) {
    const float kc = Load(key + c * s.key_channel_stride);
#pragma unroll
    for (int x = 0; x < kMaxGroup; ++x) {
      if (x < group) dots[x] += qs[x * p + c] * kc;
    }
  }
  for (int x = 0; x < group; ++x) {
    l.scores[(static_cast<int64_t>(b) * s.num_heads + g * group + x) * s.max_rows + j] =
        dots[x] * s.scale;
  }
}

// Per (head, sequence): the best score, the sum of exp(s - best), and the rows within alpha.
__global__ void StatsKernel(Speculation s, SpecLayout l) {
  __shared__ float shared[32];
  const int h = blockIdx.x, b = blockIdx.y;
  const int64_t n = NumRows(s, b);
  const float* sc = l.scores + (static_cast<int64_t>(b) * s.num_heads + h) * s.max_rows;
  float best = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) best = fmaxf(best, sc[j]);
  best = BlockMax(best, shared);
  float sum = 0.0f, count = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    sum += __expf(sc[j] - best);
    count += sc[j] > best - s.alpha ? 1.0f : 0.0f;
  }
  sum = BlockSum(sum, shared);
  count = BlockSum(count, shared);
  if (threadIdx.x == 0) {
    float* st = l.stats + (static_cast<int64_t>(b) * s.num_heads + h) * 3;
    st[0] = best, st[1] = sum, st[2] = count;
  }
}

__global__ void MassKernel(Speculation s, SpecLayout l) {
  const int g = blockIdx.y, b = blockIdx.z, group = s.num_heads / s.num_kv_heads;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= NumRows(s, b)) return;
  float mass = 0.0f;
  for (int x = 0; x < group; ++x) {
    const int64_t hb = static_cast<int64_t>(b) * s.num_heads + g * group + x;
    const float* st = l.stats + hb * 3;
    mass += __expf(l.scores[hb * s.max_rows + j] - st[0]) / st[1];
  }
  l.mass[(static_cast<int64_t>(b) * s.num_kv_heads + g) * s.max_rows + j] = mass;
}

__device__ int64_t MaxBudget(float fraction, int64_t n) {
  const int64_t k = static_cast<int64_t>(ceilf(fraction * static_cast<float>(n)));
  return Max64(1, Min64(n, k));
}

__global__ void ChooseKernel(Speculation s, SpecLayout l) {
  const int g = blockIdx.x, b = blockIdx.y;
  const int64_t n = NumRows(s, b);
  const int64_t k_max = s.k_max > 0 ? Min64(s.k_max, n) : MaxBudget(s.budget_fraction, n);
  float count_sum = 0.0f;
  for (int h = 0; h < s.num_heads; ++h) {
    count_sum += l.stats[(static_cast<int64_t>(b) * s.num_heads + h) * 3 + 2];
  }
  const int64_t lo = Min64(s.k_min, k_max);
  int64_t k = n == 0 ? 0 : Max64(lo, Min64(k_max, llroundf(count_sum / s.num_heads)));
  if (s.margin) k = Min64(n, k + 1 + Max64(2, k / 16));
  if (g == 0 && threadIdx.x == 0) s.counts[b] = static_cast<int32_t>(k);
  float* mass = l.mass + (static_cast<int64_t>(b) * s.num_kv_heads + g) * s.max_rows;
  if (s.force_last && n > 0) {  // the current token outranks every stored row
    if (threadIdx.x == 0) mass[n - 1] = FLT_MAX;
    __syncthreads();
  }
  BlockTopK(mass, n, k,
            s.indices + (static_cast<int64_t>(b) * s.num_kv_heads + g) * s.index_capacity);
}

}  // namespace

cudaError_t TopK(const float* scores, int num_kv_heads, int64_t n, int64_t k, int32_t* out,
                 cudaStream_t stream) {
  if (k > n || k < 0 || n >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  if (num_kv_heads == 0 || k == 0) return cudaSuccess;
  TopKKernel<<<num_kv_heads, kTopKThreads, 0, stream>>>(scores, n, k, out);
  return cudaGetLastError();
}

cudaError_t RunPartialProjection(const PartialProjection& p, cudaStream_t stream) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0 || p.partial_dim <= 0) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(p.num_heads, p.batch);
  IG_CUDA_DISPATCH(p.x_type, Tx, IG_CUDA_DISPATCH(p.out_type, To, {
                     PartialProjectionKernel<Tx, To><<<grid, 32, 0, stream>>>(p);
                   }));
  return cudaGetLastError();
}

int64_t SpeculationMaxBudget(float budget_fraction, int64_t n) {
  const int64_t k = static_cast<int64_t>(std::ceil(budget_fraction * static_cast<float>(n)));
  return std::max<int64_t>(1, std::min<int64_t>(n, k));
}

// The most rows RunSpeculation may choose per KV head.
int64_t SpeculationIndexBound(const Speculation& s) {
  int64_t k = s.k_max > 0 ? std::min<int64_t>(s.k_max, s.max_rows)
                          : SpeculationMaxBudget(s.budget_fraction, s.max_rows);
  if (s.margin) k = std::min<int64_t>(s.max_rows, k + 1 + std::max<int64_t>(2, k / 16));
  return k;
}

size_t SpeculationWorkspaceBytes(const Speculation& s) {
  return (static_cast<size_t>(s.batch) * (s.num_heads + s.num_kv_heads) * s.max_rows +
          static_cast<size_t>(s.batch) * s.num_heads * 3) *
         sizeof(float);
}

cudaError_t RunSpeculation(const Speculation& s, cudaStream_t stream) {
  if (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0 ||
      s.num_heads / s.num_kv_heads > kMaxGroup || s.partial_dim <= 0 ||
      s.partial_dim > kMaxPartialDim || s.workspace == nullptr || s.max_rows <= 0 ||
      s.index_capacity < SpeculationIndexBound(s)) {
    return cudaErrorInvalidValue;
  }
  const SpecLayout l = Layout(s);
  const dim3 rows_grid(Blocks(s.max_rows, kScoreThreads), s.num_kv_heads, s.batch);
  IG_CUDA_DISPATCH(s.key_type, Tk, ScoreKernel<Tk><<<rows_grid, kScoreThreads, 0, stream>>>(s, l));
  StatsKernel<<<dim3(s.num_heads, s.batch), kTopKThreads, 0, stream>>>(s, l);
  MassKernel<<<rows_grid, kScoreThreads, 0, stream>>>(s, l);
  ChooseKernel<<<dim3(s.num_kv_heads, s.batch), kTopKThreads, 0, stream>>>(s, l);
  return cudaGetLastError();
}

}  // namespace infinigen::cuda
