// Per-row top-k without a sort, for a whole thread block: a 4-pass radix select of the k-th
// largest value, then an order-preserving compaction. Shared by the selection and sampling
// kernels.
#pragma once

#include "kernels/cuda/common.cuh"

namespace infinigen::cuda {

constexpr int kTopKThreads = 1024;  // blockDim.x of every caller of BlockTopK

// Maps a float to an unsigned key with the same order, as the CPU's top-k (kernels/cpu/top_k.cc)
// keys them: NaN lowest (below -inf: a NaN mass never outranks the current token's FLT_MAX), -0
// equal to +0.
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t u = __float_as_uint(f + 0.0f);  // -0 + 0 = +0
  const uint32_t key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return f == f ? key : 0u;
}

// Exclusive prefix sums of a and b over the block (kTopKThreads threads); totals optional.
__device__ inline void BlockExclusiveScan(int& a, int& b) {
  __shared__ int warp_a[32], warp_b[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int ia = a, ib = b;
  for (int o = 1; o < 32; o <<= 1) {
    const int na = __shfl_up_sync(0xffffffffu, ia, o), nb = __shfl_up_sync(0xffffffffu, ib, o);
    if (lane >= o) ia += na, ib += nb;
  }
  if (lane == 31) warp_a[warp] = ia, warp_b[warp] = ib;
  __syncthreads();
  if (warp == 0) {
    int wa = warp_a[lane], wb = warp_b[lane];
    for (int o = 1; o < 32; o <<= 1) {
      const int na = __shfl_up_sync(0xffffffffu, wa, o), nb = __shfl_up_sync(0xffffffffu, wb, o);
      if (lane >= o) wa += na, wb += nb;
    }
    warp_a[lane] = wa, warp_b[lane] = wb;  // inclusive over warps
  }
  __syncthreads();
  const int base_a = warp > 0 ? warp_a[warp - 1] : 0, base_b = warp > 0 ? warp_b[warp - 1] : 0;
  a = base_a + ia - a;
  b = base_b + ib - b;
  __syncthreads();
}

// The k largest of vals[0, n) into out[0, k), ascending rows, ties to the lower row. Run by a
// whole block of kTopKThreads threads.
__device__ inline void BlockTopK(const float* vals, int64_t n, int64_t k, int32_t* out) {
  __shared__ unsigned hist[256];
  __shared__ uint32_t prefix_s, mask_s;
  __shared__ int64_t want_s;
  if (k <= 0) return;
  if (k >= n) {
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) out[j] = static_cast<int32_t>(j);
    return;
  }
  if (threadIdx.x == 0) prefix_s = 0, mask_s = 0, want_s = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += blockDim.x) hist[d] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s, mask = mask_s;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const uint32_t key = OrderedKey(vals[j]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t want = want_s, cum = 0;
      for (int d = 255; d >= 0; --d) {
        if (cum + hist[d] >= want) {
          want_s = want - cum;
          prefix_s = prefix | (static_cast<uint32_t>(d) << shift);
          mask_s = mask | (255u << shift);
          break;
        }
        cum += hist[d];
      }
    }
    __syncthreads();
  }
  const uint32_t threshold = prefix_s;
  const int64_t ties = want_s;  // rows equal to the threshold to take, lowest first
  const int64_t chunk = (n + blockDim.x - 1) / blockDim.x;
  const int64_t begin = Min64(n, threadIdx.x * chunk), end = Min64(n, begin + chunk);
  int gt = 0, eq = 0;
  for (int64_t j = begin; j < end; ++j) {
    const uint32_t key = OrderedKey(vals[j]);
    gt += key > threshold;
    eq += key == threshold;
  }
  BlockExclusiveScan(gt, eq);
  int64_t pos = gt + Min64(eq, ties), eq_seen = eq;
  for (int64_t j = begin; j < end; ++j) {
    const uint32_t key = OrderedKey(vals[j]);
    if (key > threshold || (key == threshold && eq_seen++ < ties)) {
      out[pos++] = static_cast<int32_t>(j);
    }
  }
}

}  // namespace infinigen::cuda
