// Token choice on the device: greedy argmax, and the reference sampler of kernels/cpu/sampling.h
// over the top-k candidates (found by radix select, then sorted in one thread). Ties with the
// k-th logit are kept as Hugging Face keeps them, up to 2 * kMaxSampleTopK candidates in all.
#include "kernels/cpu/philox.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/topk.cuh"

namespace infinigen::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kCandidates = 2 * kMaxSampleTopK;  // the top k and ties with the k-th

__global__ void ArgmaxKernel(const float* logits, int64_t vocab, int32_t* tokens) {
  __shared__ float best_v[32];
  __shared__ int64_t best_i[32];
  const float* row = logits + blockIdx.x * vocab;
  float v = -INFINITY;
  int64_t i = vocab;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    if (row[j] > v) v = row[j], i = j;  // strided ascending: the first maximum seen is lowest
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) best_v[warp] = v, best_i[warp] = i;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
      if (best_v[w] > v || (best_v[w] == v && best_i[w] < i)) v = best_v[w], i = best_i[w];
    }
    tokens[blockIdx.x] = static_cast<int32_t>(i < vocab ? i : 0);
  }
}

__global__ void SampleKernel(Sample s) {
  __shared__ int32_t ids[kCandidates];
  __shared__ float probs[kCandidates];
  __shared__ float kth_s;
  __shared__ int32_t last_tie_s, count_s;
  const float* row = s.logits + blockIdx.x * s.vocab;
  const int64_t top = Min64(s.top_k, s.vocab);
  BlockTopK(row, s.vocab, top, ids);
  __syncthreads();
  // Hugging Face keeps every token tied with the k-th: add the ties the select left out (they
  // have higher ids than the ones it took), as many as fit.
  if (threadIdx.x == 0) {
    float kth = row[ids[0]];
    for (int64_t a = 1; a < top; ++a) kth = fminf(kth, row[ids[a]]);
    int32_t last = -1;
    for (int64_t a = 0; a < top; ++a) {
      if (row[ids[a]] == kth && ids[a] > last) last = ids[a];
    }
    kth_s = kth, last_tie_s = last, count_s = static_cast<int32_t>(top);
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < s.vocab; j += blockDim.x) {
    if (row[j] == kth_s && j > last_tie_s) {
      const int32_t slot = atomicAdd(&count_s, 1);
      if (slot < kCandidates) ids[slot] = static_cast<int32_t>(j);
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int64_t k = Min64(count_s, kCandidates);
  // Sort the candidates by logit, descending, ties to the lower id (k <= 512: insertion sort).
  for (int64_t a = 1; a < k; ++a) {
    const int32_t id = ids[a];
    int64_t b = a;
    while (b > 0 &&
           (row[ids[b - 1]] < row[id] || (row[ids[b - 1]] == row[id] && ids[b - 1] > id))) {
      ids[b] = ids[b - 1];
      --b;
    }
    ids[b] = id;
  }
  const float inv_t = 1.0f / s.temperature;
  const float max_logit = row[ids[0]] * inv_t;
  double sum = 0.0;
  for (int64_t a = 0; a < k; ++a) {
    probs[a] = expf(row[ids[a]] * inv_t - max_logit);
    sum += probs[a];
  }
  for (int64_t a = 0; a < k; ++a) probs[a] = static_cast<float>(probs[a] / sum);
  int64_t keep = k;
  if (s.top_p < 1.0f) {
    double cum = 0.0;
    int64_t n = 0;
    while (n < keep) {
      cum += probs[n];
      ++n;
      if (cum >= s.top_p) break;
    }
    keep = n > 1 ? n : 1;
  }
  if (s.min_p > 0.0f) {
    const float threshold = s.min_p * probs[0];
    int64_t n = 1;
    while (n < keep && probs[n] >= threshold) ++n;
    keep = n;
  }
  double total = 0.0;
  for (int64_t a = 0; a < keep; ++a) total += probs[a];
  const double u = UniformForPosition(s.seeds[blockIdx.x], s.positions[blockIdx.x]) * total;
  double cum = 0.0;
  int32_t token = ids[keep - 1];
  for (int64_t a = 0; a < keep; ++a) {
    cum += probs[a];
    if (u < cum) {
      token = ids[a];
      break;
    }
  }
  s.tokens[blockIdx.x] = token;
}

}  // namespace

cudaError_t Argmax(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                   cudaStream_t stream) {
  if (vocab <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  ArgmaxKernel<<<rows, kThreads, 0, stream>>>(logits, vocab, tokens);
  return cudaGetLastError();
}

cudaError_t RunSample(const Sample& s, cudaStream_t stream) {
  if (s.top_k < 1 || s.top_k > kMaxSampleTopK || !(s.temperature > 0.0f) || s.vocab <= 0 ||
      s.vocab >= (int64_t{1} << 31)) {
    return cudaErrorInvalidValue;
  }
  if (s.rows == 0) return cudaSuccess;
  SampleKernel<<<s.rows, kThreads, 0, stream>>>(s);
  return cudaGetLastError();
}

}  // namespace infinigen::cuda
