// Row-wise and elementwise kernels: embedding, norms, RoPE, activations, adds and copies.
#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace infinigen::cuda {
namespace {

constexpr int kThreads = 256;

template <typename Ti, typename To>
__global__ void EmbeddingKernel(const Ti* table, const int32_t* ids, int64_t cols, To* out,
                                int64_t out_stride) {
  const Ti* src = table + static_cast<int64_t>(ids[blockIdx.x]) * cols;
  To* dst = out + blockIdx.x * out_stride;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) Store(dst + c, Load(src + c));
}

template <typename T>
__global__ void RmsNormKernel(const T* x, int64_t x_stride, const float* w, int64_t cols, float eps,
                              T* out, int64_t out_stride) {
  __shared__ float shared[32];
  const T* xr = x + blockIdx.x * x_stride;
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = Load(xr + c);
    sum += v * v;
  }
  sum = BlockSum(sum, shared);
  const float inv = rsqrtf(sum / static_cast<float>(cols) + eps);
  T* o = out + blockIdx.x * out_stride;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) Store(o + c, Load(xr + c) * inv * w[c]);
}

template <typename T>
__global__ void LayerNormKernel(const T* x, int64_t x_stride, const float* w, const float* b,
                                int64_t cols, float eps, T* out, int64_t out_stride) {
  __shared__ float shared[32];
  const T* xr = x + blockIdx.x * x_stride;
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += Load(xr + c);
  const float mean = BlockSum(sum, shared) / static_cast<float>(cols);
  float var = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = Load(xr + c) - mean;
    var += d * d;
  }
  const float inv = rsqrtf(BlockSum(var, shared) / static_cast<float>(cols) + eps);
  T* o = out + blockIdx.x * out_stride;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = (Load(xr + c) - mean) * inv;
    Store(o + c, v * (w != nullptr ? w[c] : 1.0f) + (b != nullptr ? b[c] : 0.0f));
  }
}

// One block per row; thread i handles channel pair i of every head.
template <typename T>
__global__ void RopeKernel(T* x, int64_t stride, int num_heads, int head_dim, int rotary_dim,
                           const int32_t* positions, const float* inv_freq, bool interleaved,
                           int64_t inv_freq_head_stride) {
  const int half = rotary_dim / 2;
  const float pos = static_cast<float>(positions[blockIdx.x]);
  T* row = x + blockIdx.x * stride;
  for (int t = threadIdx.x; t < half * num_heads; t += blockDim.x) {
    const int h = t / half, i = t % half;
    const float angle = pos * inv_freq[h * inv_freq_head_stride + i];  // f32, as the CPU
    float s, c;
    sincosf(angle, &s, &c);
    T* head = row + static_cast<int64_t>(h) * head_dim;
    T* a = interleaved ? head + 2 * i : head + i;
    T* b = interleaved ? head + 2 * i + 1 : head + i + half;
    const float x0 = Load(a), x1 = Load(b);
    Store(a, x0 * c - x1 * s);
    Store(b, x1 * c + x0 * s);
  }
}

enum class Op { kSwiGlu, kRelu, kAdd, kAddBias, kCopy };

// out[r, c] = f(a[r, c], b[r, c]) over a rows x cols grid (2-D grid: rows, column blocks).
template <Op op, typename Ta, typename To>
__global__ void MapKernel(const Ta* a, int64_t a_stride, const To* b, int64_t b_stride,
                          const float* bias, To* out, int64_t out_stride, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t r = blockIdx.y;
  const float x = Load(a + r * a_stride + c);
  float y;
  if constexpr (op == Op::kSwiGlu) {
    y = x / (1.0f + expf(-x)) * Load(b + r * b_stride + c);
  } else if constexpr (op == Op::kRelu) {
    y = fmaxf(x, 0.0f);
  } else if constexpr (op == Op::kAdd) {
    y = x + Load(b + r * b_stride + c);
  } else if constexpr (op == Op::kAddBias) {
    y = x + bias[c];
  } else {
    y = x;
  }
  Store(out + r * out_stride + c, y);
}

template <Op op, typename Ta, typename To>
cudaError_t Map(const Mat& a, const Mat* b, const float* bias, const Mat& out,
                cudaStream_t stream) {
  if (out.rows == 0 || out.cols == 0) return cudaSuccess;
  if (out.rows > 65535) return cudaErrorInvalidValue;
  const dim3 grid(Blocks(out.cols, kThreads), static_cast<unsigned>(out.rows));
  MapKernel<op, Ta, To><<<grid, kThreads, 0, stream>>>(
      static_cast<const Ta*>(a.data), a.stride, b ? static_cast<const To*>(b->data) : nullptr,
      b ? b->stride : 0, bias, static_cast<To*>(out.data), out.stride, out.cols);
  return cudaGetLastError();
}

template <typename T>
__global__ void FillKernel(T* data, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    Store(data + i, (static_cast<float>(z >> 40) * (1.0f / 8388608.0f) - 1.0f) * scale);
  }
}

bool SameShape(const Mat& a, const Mat& b) { return a.rows == b.rows && a.cols == b.cols; }

}  // namespace

cudaError_t Embedding(const void* table, Elem table_type, const int32_t* ids, Mat out,
                      cudaStream_t stream) {
  if (out.rows == 0) return cudaSuccess;
  IG_CUDA_DISPATCH(table_type, Ti, IG_CUDA_DISPATCH(out.type, To, {
                     EmbeddingKernel<Ti, To><<<out.rows, kThreads, 0, stream>>>(
                         static_cast<const Ti*>(table), ids, out.cols, static_cast<To*>(out.data),
                         out.stride);
                   }));
  return cudaGetLastError();
}

cudaError_t RmsNorm(Mat x, const float* weight, float eps, Mat out, cudaStream_t stream) {
  if (!SameShape(x, out) || x.type != out.type) return cudaErrorInvalidValue;
  if (x.rows == 0) return cudaSuccess;
  IG_CUDA_DISPATCH(x.type, T, {
    RmsNormKernel<T><<<x.rows, kThreads, 0, stream>>>(static_cast<const T*>(x.data), x.stride,
                                                      weight, x.cols, eps,
                                                      static_cast<T*>(out.data), out.stride);
  });
  return cudaGetLastError();
}

cudaError_t LayerNorm(Mat x, const float* weight, const float* bias, float eps, Mat out,
                      cudaStream_t stream) {
  if (!SameShape(x, out) || x.type != out.type) return cudaErrorInvalidValue;
  if (x.rows == 0) return cudaSuccess;
  IG_CUDA_DISPATCH(x.type, T, {
    LayerNormKernel<T><<<x.rows, kThreads, 0, stream>>>(static_cast<const T*>(x.data), x.stride,
                                                        weight, bias, x.cols, eps,
                                                        static_cast<T*>(out.data), out.stride);
  });
  return cudaGetLastError();
}

cudaError_t Rope(Mat x, int num_heads, int head_dim, int rotary_dim, const int32_t* positions,
                 const float* inv_freq, bool interleaved, cudaStream_t stream,
                 int64_t inv_freq_head_stride) {
  if (rotary_dim > head_dim || rotary_dim % 2 != 0 || x.cols < num_heads * head_dim) {
    return cudaErrorInvalidValue;
  }
  if (x.rows == 0 || rotary_dim == 0) return cudaSuccess;
  IG_CUDA_DISPATCH(x.type, T, {
    RopeKernel<T><<<x.rows, 128, 0, stream>>>(static_cast<T*>(x.data), x.stride, num_heads,
                                              head_dim, rotary_dim, positions, inv_freq,
                                              interleaved, inv_freq_head_stride);
  });
  return cudaGetLastError();
}

cudaError_t SwiGlu(Mat gate, Mat up, Mat out, cudaStream_t stream) {
  if (!SameShape(gate, up) || !SameShape(gate, out) || gate.type != up.type ||
      gate.type != out.type) {
    return cudaErrorInvalidValue;
  }
  IG_CUDA_DISPATCH(gate.type, T, return Map<Op::kSwiGlu, T, T>(gate, &up, nullptr, out, stream));
  return cudaErrorInvalidValue;
}

cudaError_t Relu(Mat x, cudaStream_t stream) {
  IG_CUDA_DISPATCH(x.type, T, return Map<Op::kRelu, T, T>(x, nullptr, nullptr, x, stream));
  return cudaErrorInvalidValue;
}

cudaError_t Add(Mat x, Mat y, cudaStream_t stream) {
  if (!SameShape(x, y) || x.type != y.type) return cudaErrorInvalidValue;
  IG_CUDA_DISPATCH(x.type, T, return Map<Op::kAdd, T, T>(x, &y, nullptr, y, stream));
  return cudaErrorInvalidValue;
}

cudaError_t AddBias(const float* bias, Mat y, cudaStream_t stream) {
  IG_CUDA_DISPATCH(y.type, T, return Map<Op::kAddBias, T, T>(y, nullptr, bias, y, stream));
  return cudaErrorInvalidValue;
}

cudaError_t FillRandom(void* data, Elem type, int64_t n, uint64_t seed, float scale,
                       cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(Blocks(n, kThreads), 65536));
  IG_CUDA_DISPATCH(type, T,
                   FillKernel<T>
                   <<<blocks, kThreads, 0, stream>>>(static_cast<T*>(data), n, seed, scale));
  return cudaGetLastError();
}

cudaError_t Copy(Mat src, Mat dst, cudaStream_t stream) {
  if (!SameShape(src, dst)) return cudaErrorInvalidValue;
  if (src.rows == 0 || src.cols == 0) return cudaSuccess;
  if (src.type == dst.type) {
    const size_t e = ElemSize(src.type);
    return cudaMemcpy2DAsync(dst.data, dst.stride * e, src.data, src.stride * e, src.cols * e,
                             src.rows, cudaMemcpyDeviceToDevice, stream);
  }
  IG_CUDA_DISPATCH(src.type, Ta, IG_CUDA_DISPATCH(dst.type, To, {
                     return Map<Op::kCopy, Ta, To>(src, nullptr, nullptr, dst, stream);
                   }));
  return cudaErrorInvalidValue;
}

}  // namespace infinigen::cuda
