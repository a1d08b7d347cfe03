// Device helpers shared by the CUDA kernels: element loads and stores in f32, warp and block
// reductions, and the dispatch from Elem to a C++ type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/ops.h"

namespace infinigen::cuda {

__device__ __forceinline__ float Load(const float* p) { return *p; }
__device__ __forceinline__ float Load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float Load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void Store(float* p, float v) { *p = v; }
__device__ __forceinline__ void Store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void Store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

__host__ __device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 floats; the call synchronizes the block.
__device__ __forceinline__ float BlockSum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.0f;
  return WarpSum(v);
}
__device__ __forceinline__ float BlockMax(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -FLT_MAX;
  return WarpMax(v);
}

inline unsigned Blocks(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace infinigen::cuda

// Runs the statements with `T` aliased to the C++ type of `elem`.
#define IG_CUDA_DISPATCH(elem, T, ...)     \
  switch (elem) {                          \
    case ::infinigen::cuda::Elem::kF32: {  \
      using T = float;                     \
      __VA_ARGS__;                         \
      break;                               \
    }                                      \
    case ::infinigen::cuda::Elem::kF16: {  \
      using T = __half;                    \
      __VA_ARGS__;                         \
      break;                               \
    }                                      \
    case ::infinigen::cuda::Elem::kBF16: { \
      using T = __nv_bfloat16;             \
      __VA_ARGS__;                         \
      break;                               \
    }                                      \
  }
