// Attention kernels: causal prefill through shared-memory tiles, and split decode attention
// (flash-decoding) over listed rows plus the current token, with GQA.
#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace infinigen::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kQueryTile = 16;                     // query rows per causal block
constexpr int kRowsPerWarp = kQueryTile / kWarps;  // each warp owns 4 of them

// ---- causal prefill ----

// Block (query tile, head): K/V tiles of `key_tile` rows in shared memory (f32, rows padded by
// one float against bank conflicts); lane j scores key j of the tile for each of the warp's
// query rows; online softmax; lane owns channels lane + 32 * i of the output.
template <typename T, int MAXC>
__global__ void CausalKernel(const T* q, int64_t q_stride, int64_t num_q, int64_t q_start,
                             const T* k, const T* v, int64_t head_stride, int64_t row_stride,
                             int group, int head_dim, float scale, int key_tile, T* out,
                             int64_t out_stride) {
  extern __shared__ float smem[];
  const int pitch = head_dim + 1;
  float* qs = smem;                     // [kQueryTile, pitch]
  float* ks = qs + kQueryTile * pitch;  // [key_tile, pitch]
  float* vs = ks + key_tile * pitch;    // [key_tile, pitch]
  const int h = blockIdx.y, g = h / group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kQueryTile;
  const int64_t q_rows = Min64(kQueryTile, num_q - q0);
  for (int t = threadIdx.x; t < kQueryTile * head_dim; t += blockDim.x) {
    const int r = t / head_dim, c = t % head_dim;
    qs[r * pitch + c] = r < q_rows ? Load(q + (q0 + r) * q_stride + h * head_dim + c) : 0.0f;
  }
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][MAXC];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = -FLT_MAX;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < MAXC; ++i) acc[r][i] = 0.0f;
  }
  const T* kh = k + g * head_stride;
  const T* vh = v + g * head_stride;
  const int64_t keys = q_start + q0 + q_rows;  // keys the last query row of the tile sees
  for (int64_t k0 = 0; k0 < keys; k0 += key_tile) {
    __syncthreads();
    for (int t = threadIdx.x; t < key_tile * head_dim; t += blockDim.x) {
      const int r = t / head_dim, c = t % head_dim;
      const bool in = k0 + r < keys;
      ks[r * pitch + c] = in ? Load(kh + (k0 + r) * row_stride + c) : 0.0f;
      vs[r * pitch + c] = in ? Load(vh + (k0 + r) * row_stride + c) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int qr = warp * kRowsPerWarp + r;
      if (qr >= q_rows) break;
      const int64_t pos = q_start + q0 + qr;
      float s = -FLT_MAX;
      if (lane < key_tile && k0 + lane <= pos) {
        const float* qv = qs + qr * pitch;
        const float* kv = ks + lane * pitch;
        float dot = 0.0f;
        for (int c = 0; c < head_dim; ++c) dot += qv[c] * kv[c];
        s = dot * scale;
      }
      const float tile_max = WarpMax(s);
      if (tile_max == -FLT_MAX) continue;  // every key of the tile is in this row's future
      const float m_new = fmaxf(m[r], tile_max);
      const float corr = __expf(m[r] - m_new);
      const float p = s == -FLT_MAX ? 0.0f : __expf(s - m_new);
      l[r] = l[r] * corr + WarpSum(p);
      m[r] = m_new;
#pragma unroll
      for (int i = 0; i < MAXC; ++i) acc[r][i] *= corr;
      for (int j = 0; j < key_tile; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        if (pj == 0.0f) continue;
        const float* vr = vs + j * pitch;
#pragma unroll
        for (int i = 0; i < MAXC; ++i) {
          const int c = lane + 32 * i;
          if (c < head_dim) acc[r][i] += pj * vr[c];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int qr = warp * kRowsPerWarp + r;
    if (qr >= q_rows) break;
    T* o = out + (q0 + qr) * out_stride + h * head_dim;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
#pragma unroll
    for (int i = 0; i < MAXC; ++i) {
      const int c = lane + 32 * i;
      if (c < head_dim) Store(o + c, acc[r][i] * inv);
    }
  }
}

// ---- split decode ----

constexpr int kDecodeTargetBlocks = 2048;
constexpr int kMinRowsPerSplit = 64;

struct Split {
  int splits;
  int rows_per_split;
};

Split DecodeSplit(const DecodeAttention& a) {
  const int64_t rows = (a.max_rows > 0 ? a.max_rows : a.num_rows) + (a.k_cur != nullptr ? 1 : 0);
  const int64_t per_wave = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  int64_t splits = (kDecodeTargetBlocks + per_wave - 1) / per_wave;
  splits = std::max<int64_t>(1, std::min(splits, (rows + kMinRowsPerSplit - 1) / kMinRowsPerSplit));
  const int64_t per = std::max<int64_t>(1, (rows + splits - 1) / splits);
  // Recount with the rounded split size, so that no split is empty (one split when rows = 0).
  return {static_cast<int>(std::max<int64_t>(1, (rows + per - 1) / per)), static_cast<int>(per)};
}

// Partials: [batch, num_heads, splits, head_dim + 2] floats (acc..., m, l).
template <typename T, int MAXC, int G>
__global__ void DecodeKernel(DecodeAttention a, int rows_per_split, int splits) {
  __shared__ float red[kWarps][G][2];
  __shared__ float red_acc[kWarps][G][MAXC * 32];
  const int split = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = a.num_heads / a.num_kv_heads, hd = a.head_dim;
  // A sequence of its own (a.seqs): its pointers, count and split; its splits past its own
  // write nothing (the combine reads only its own).
  const DecodeSeq* seq = a.seqs != nullptr ? a.seqs + b : nullptr;
  if (seq != nullptr) {
    if (split >= seq->splits) return;
    rows_per_split = seq->rows_per_split;
  }
  const int64_t count =
      seq != nullptr
          ? (seq->count != nullptr ? Max64(0, Min64(*seq->count, seq->num_rows)) : seq->num_rows)
      : a.num_rows_per_seq != nullptr
          ? Max64(0, Min64(a.num_rows_per_seq[b], a.max_rows > 0 ? a.max_rows : a.num_rows))
          : a.num_rows;
  const int64_t total = count + (a.k_cur != nullptr ? 1 : 0);
  const int64_t begin = static_cast<int64_t>(split) * rows_per_split;
  const int64_t end = Min64(total, begin + rows_per_split);

  float q[G][MAXC];
  const T* qb = seq != nullptr ? static_cast<const T*>(seq->q)
                               : static_cast<const T*>(a.q) + b * a.q_seq_stride;
#pragma unroll
  for (int x = 0; x < G; ++x) {
#pragma unroll
    for (int i = 0; i < MAXC; ++i) {
      const int c = lane + 32 * i;
      q[x][i] = (x < group && c < hd) ? Load(qb + (g * group + x) * hd + c) : 0.0f;
    }
  }
  float m[G], l[G], acc[G][MAXC];
#pragma unroll
  for (int x = 0; x < G; ++x) {
    m[x] = -FLT_MAX;
    l[x] = 0.0f;
#pragma unroll
    for (int i = 0; i < MAXC; ++i) acc[x][i] = 0.0f;
  }
  const T* kb = seq != nullptr
                    ? static_cast<const T*>(seq->k) + g * seq->head_stride
                    : static_cast<const T*>(a.k) + b * a.kv_seq_stride + g * a.head_stride;
  const T* vb = seq != nullptr
                    ? static_cast<const T*>(seq->v) + g * seq->head_stride
                    : static_cast<const T*>(a.v) + b * a.kv_seq_stride + g * a.head_stride;
  const int32_t* idx =
      seq != nullptr
          ? (seq->indices != nullptr ? seq->indices + g * seq->index_head_stride : nullptr)
      : a.indices != nullptr ? a.indices + b * a.index_seq_stride + g * a.index_head_stride
                             : nullptr;
  for (int64_t j = begin + warp; j < end; j += kWarps) {
    const T *kr, *vr;
    if (j < count) {
      const int64_t row = idx != nullptr ? idx[j] : j;
      kr = kb + row * a.row_stride;
      vr = vb + row * a.row_stride;
    } else {  // the current token
      kr = static_cast<const T*>(a.k_cur) + b * a.cur_seq_stride + g * hd;
      vr = static_cast<const T*>(a.v_cur) + b * a.cur_seq_stride + g * hd;
    }
    float kv[MAXC], vv[MAXC];
#pragma unroll
    for (int i = 0; i < MAXC; ++i) {
      const int c = lane + 32 * i;
      kv[i] = c < hd ? Load(kr + c) : 0.0f;
      vv[i] = c < hd ? Load(vr + c) : 0.0f;
    }
#pragma unroll
    for (int x = 0; x < G; ++x) {
      if (x >= group) break;
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < MAXC; ++i) dot += q[x][i] * kv[i];
      const float s = WarpSum(dot) * a.scale;
      if (a.weights != nullptr && lane == 0 && j < count) {
        a.weights[static_cast<int64_t>(g * group + x) * count + j] = s;
      }
      const float m_new = fmaxf(m[x], s);
      const float corr = __expf(m[x] - m_new);
      const float p = __expf(s - m_new);
      l[x] = l[x] * corr + p;
      m[x] = m_new;
#pragma unroll
      for (int i = 0; i < MAXC; ++i) acc[x][i] = acc[x][i] * corr + p * vv[i];
    }
  }
  // Merge the warps' states, then write this split's partial per query head.
#pragma unroll
  for (int x = 0; x < G; ++x) {
    if (lane == 0) {
      red[warp][x][0] = m[x];
      red[warp][x][1] = l[x];
    }
#pragma unroll
    for (int i = 0; i < MAXC; ++i) red_acc[warp][x][lane + 32 * i] = acc[x][i];
  }
  __syncthreads();
  float* ws = static_cast<float*>(a.workspace);
  for (int t = threadIdx.x; t < group * (hd + 2); t += blockDim.x) {
    const int x = t / (hd + 2), c = t % (hd + 2);
    float mm = -FLT_MAX;
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, red[w][x][0]);
    float value = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      if (red[w][x][1] == 0.0f) continue;
      const float f = __expf(red[w][x][0] - mm);
      value += (c < hd ? red_acc[w][x][c] : c == hd + 1 ? red[w][x][1] : 0.0f) * f;
    }
    if (c == hd) value = mm;
    const int h = g * group + x;
    ws[((static_cast<int64_t>(b) * a.num_heads + h) * splits + split) * (hd + 2) + c] = value;
  }
}

template <typename T>
__global__ void CombineKernel(DecodeAttention a, int splits) {
  const int h = blockIdx.x, b = blockIdx.y, hd = a.head_dim;
  const float* ws = static_cast<const float*>(a.workspace) +
                    (static_cast<int64_t>(b) * a.num_heads + h) * splits * (hd + 2);
  const DecodeSeq* seq = a.seqs != nullptr ? a.seqs + b : nullptr;
  if (seq != nullptr) splits = seq->splits;  // its own (the workspace's stride stays the most)
  float mm = -FLT_MAX;
  for (int s = 0; s < splits; ++s) {
    if (ws[s * (hd + 2) + hd + 1] > 0.0f) mm = fmaxf(mm, ws[s * (hd + 2) + hd]);
  }
  float total = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float ls = ws[s * (hd + 2) + hd + 1];
    if (ls > 0.0f) total += ls * __expf(ws[s * (hd + 2) + hd] - mm);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  T* o =
      (seq != nullptr ? static_cast<T*>(seq->out) : static_cast<T*>(a.out) + b * a.out_seq_stride) +
      h * hd;
  for (int c = threadIdx.x; c < hd; c += blockDim.x) {
    float v = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float ls = ws[s * (hd + 2) + hd + 1];
      if (ls > 0.0f) v += ws[s * (hd + 2) + c] * __expf(ws[s * (hd + 2) + hd] - mm);
    }
    Store(o + c, v * inv);
  }
  if (a.weights != nullptr) {
    float* w = a.weights + static_cast<int64_t>(h) * a.num_rows;
    for (int j = threadIdx.x; j < a.num_rows; j += blockDim.x) w[j] = expf(w[j] - mm) * inv;
  }
}

int PerLane(int head_dim) {
  const int n = (head_dim + 31) / 32;
  return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : n <= 8 ? 8 : 0;
}

template <typename T, int MAXC>
cudaError_t LaunchDecode(const DecodeAttention& a, int group, Split sp, cudaStream_t stream) {
  const dim3 grid(sp.splits, a.num_kv_heads, a.batch);
  switch (group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8) {
    case 1:
      DecodeKernel<T, MAXC, 1><<<grid, kWarps * 32, 0, stream>>>(a, sp.rows_per_split, sp.splits);
      break;
    case 2:
      DecodeKernel<T, MAXC, 2><<<grid, kWarps * 32, 0, stream>>>(a, sp.rows_per_split, sp.splits);
      break;
    case 4:
      DecodeKernel<T, MAXC, 4><<<grid, kWarps * 32, 0, stream>>>(a, sp.rows_per_split, sp.splits);
      break;
    default:
      DecodeKernel<T, MAXC, 8><<<grid, kWarps * 32, 0, stream>>>(a, sp.rows_per_split, sp.splits);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t AttentionCausal(Mat q, int64_t q_start, KvMat k, KvMat v, int num_heads,
                            int num_kv_heads, int head_dim, float scale, Mat out,
                            cudaStream_t stream) {
  const int per_lane = PerLane(head_dim);
  if (per_lane == 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || q.type != out.type ||
      q.rows != out.rows) {
    return cudaErrorInvalidValue;
  }
  if (q.rows == 0) return cudaSuccess;
  const int key_tile = head_dim <= 128 ? 32 : 16;
  const size_t smem = static_cast<size_t>(kQueryTile + 2 * key_tile) * (head_dim + 1) * 4;
  const dim3 grid(Blocks(q.rows, kQueryTile), num_heads);
  const int group = num_heads / num_kv_heads;
  IG_CUDA_DISPATCH(q.type, T, {
    auto launch = [&](auto kernel) {
      if (smem > 48 * 1024) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
      }
      kernel<<<grid, kWarps * 32, smem, stream>>>(
          static_cast<const T*>(q.data), q.stride, q.rows, q_start, static_cast<const T*>(k.data),
          static_cast<const T*>(v.data), k.head_stride, k.row_stride, group, head_dim, scale,
          key_tile, static_cast<T*>(out.data), out.stride);
    };
    switch (per_lane) {
      case 1:
        launch(CausalKernel<T, 1>);
        break;
      case 2:
        launch(CausalKernel<T, 2>);
        break;
      case 4:
        launch(CausalKernel<T, 4>);
        break;
      default:
        launch(CausalKernel<T, 8>);
    }
  });
  return cudaGetLastError();
}

// ---- causal softmax of a score tile (the GEMM prefill) ----

namespace {

// Row i of `s` (scores q.k of query position first_pos + i against keys 0 .. cols-1) becomes
// softmax(scale * s) over the keys at or before that position, 0 after it. One block per row.
template <typename T>
__global__ void CausalSoftmaxKernel(const float* s, int64_t s_stride, int64_t cols,
                                    int64_t first_pos, float scale, T* p, int64_t p_stride) {
  __shared__ float red[32];
  const int64_t i = blockIdx.x;
  const float* row = s + i * s_stride;
  T* out = p + i * p_stride;
  const int64_t valid = Min64(cols, first_pos + i + 1);
  float m = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, row[j]);
  m = BlockMax(m, red);
  float l = 0.0f;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) l += __expf((row[j] - m) * scale);
  l = BlockSum(l, red);
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    Store(out + j, j < valid ? __expf((row[j] - m) * scale) * inv : 0.0f);
  }
}

}  // namespace

cudaError_t CausalSoftmax(const float* s, int64_t s_stride, int64_t rows, int64_t cols,
                          int64_t first_pos, float scale, Mat p, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (p.rows < rows || p.cols < cols || scale <= 0.0f || rows > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  IG_CUDA_DISPATCH(p.type, T, {
    CausalSoftmaxKernel<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
        s, s_stride, cols, first_pos, scale, static_cast<T*>(p.data), p.stride);
  });
  return cudaGetLastError();
}

size_t DecodeAttentionWorkspaceBytes(const DecodeAttention& a) {
  const int splits = a.seqs != nullptr ? a.max_splits : DecodeSplit(a).splits;
  return static_cast<size_t>(a.batch) * a.num_heads * splits * (a.head_dim + 2) * 4;
}

size_t DecodeAttentionWorkspaceBound(int batch, int num_heads, int num_kv_heads, int head_dim) {
  if (batch <= 0 || num_kv_heads <= 0) return 0;
  const size_t splits = (kDecodeTargetBlocks + num_kv_heads - 1) / num_kv_heads;
  return static_cast<size_t>(batch) * num_heads * splits * (head_dim + 2) * 4;
}

void DecodeSplitFor(int num_kv_heads, int64_t num_rows, int32_t* splits, int32_t* rows_per_split) {
  DecodeAttention one;
  one.batch = 1;
  one.num_kv_heads = num_kv_heads;
  one.num_rows = static_cast<int32_t>(num_rows);
  const Split sp = DecodeSplit(one);
  *splits = sp.splits;
  *rows_per_split = sp.rows_per_split;
}

cudaError_t RunDecodeAttention(const DecodeAttention& a, cudaStream_t stream) {
  const int per_lane = PerLane(a.head_dim);
  if (per_lane == 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 ||
      a.num_heads / a.num_kv_heads > 8 || a.batch <= 0 || a.workspace == nullptr ||
      (a.weights != nullptr &&
       (a.batch != 1 || a.k_cur != nullptr || a.num_rows_per_seq != nullptr)) ||
      (a.seqs != nullptr && (a.weights != nullptr || a.k_cur != nullptr || a.max_splits < 1))) {
    return cudaErrorInvalidValue;
  }
  const int group = a.num_heads / a.num_kv_heads;
  // Per sequence: the grid covers the most splits (each block of a sequence takes its own size).
  const Split sp = a.seqs != nullptr ? Split{a.max_splits, 1} : DecodeSplit(a);
  cudaError_t err = cudaSuccess;
  IG_CUDA_DISPATCH(a.type, T, {
    switch (per_lane) {
      case 1:
        err = LaunchDecode<T, 1>(a, group, sp, stream);
        break;
      case 2:
        err = LaunchDecode<T, 2>(a, group, sp, stream);
        break;
      case 4:
        err = LaunchDecode<T, 4>(a, group, sp, stream);
        break;
      default:
        err = LaunchDecode<T, 8>(a, group, sp, stream);
    }
    if (err != cudaSuccess) return err;
    CombineKernel<T><<<dim3(a.num_heads, a.batch), 128, 0, stream>>>(a, sp.splits);
  });
  return cudaGetLastError();
}

}  // namespace infinigen::cuda
