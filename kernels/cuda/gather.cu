// Moving K/V rows between host memory and the GPU: the gather of selected rows from a
// host-mapped cache into packed staging (reading host memory over the link from the kernel),
// and the scatter of the current token's rows into a cache.
#include <algorithm>
#include <initializer_list>

#include "kernels/cuda/common.cuh"

namespace infinigen::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kBytesPerBlock = 8192;

// Byte offset in the arena of row index `slot` of a block-table list, or -1 where the slot or
// its block falls outside the table or the arena.
// (arena_blocks: the blocks that fit in the arena; a block id is checked against them before it
// is multiplied.)
__device__ inline int64_t TableRowOffset(const Gather& g, const int32_t* table, int64_t slot,
                                         int64_t arena_blocks) {
  if (slot < 0 || slot / g.table_rows >= g.table_capacity) return -1;
  const int64_t block = table[slot / g.table_rows];
  if (block < 0 || block >= arena_blocks) return -1;
  const int64_t at = block * g.block_bytes + (slot % g.table_rows) * g.row_bytes;
  return at + g.row_bytes > g.src_bytes ? -1 : at;
}

template <typename V>
__global__ void GatherKernel(Gather g, int64_t rows_per_block) {
  const int head = blockIdx.y, b = blockIdx.z;
  const bool by_table = g.tables != nullptr;
  const int64_t list_index = static_cast<int64_t>(b) * g.num_kv_heads + head;
  int64_t count = g.list_counts != nullptr ? g.list_counts[list_index]
                  : g.counts != nullptr    ? g.counts[b]
                                           : g.count;
  const int64_t bound = g.max_count > 0 ? g.max_count : g.count;
  if (count > bound) {  // the grid stops at the bound: rows past it are not gathered
    if (by_table && g.errors != nullptr && (head == 0 || g.list_counts != nullptr) &&
        blockIdx.x == 0 && threadIdx.x == 0) {
      atomicAdd(g.errors, 1);
    }
    count = bound;
  }
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t rows = Min64(rows_per_block, count - first);
  if (rows <= 0) return;
  const int64_t vecs = g.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t list = static_cast<int64_t>(b) * g.num_kv_heads + head;
  const int32_t* idx = g.indices + list * g.index_capacity + first;
  const int32_t* table = by_table ? g.tables + list * g.table_capacity : nullptr;
  const int64_t arena_blocks = by_table ? g.src_bytes / g.block_bytes : 0;
  const char* src = static_cast<const char*>(g.src) +
                    (by_table ? 0 : b * g.src_seq_stride + head * g.src_head_stride);
  char* dst = static_cast<char*>(g.dst) + list * g.dst_rows_per_head * g.row_bytes;
  const int32_t* dst_rows =
      g.dst_rows != nullptr ? g.dst_rows + list * g.index_capacity + first : nullptr;
  for (int64_t t = threadIdx.x; t < rows * vecs; t += blockDim.x) {
    const int64_t r = t / vecs, v = t % vecs;
    const int64_t d = dst_rows != nullptr ? dst_rows[r] : first + r;
    if (d < 0 || d >= g.dst_rows_per_head) {  // nowhere to write it
      if (v == 0 && g.errors != nullptr) atomicAdd(g.errors, 1);
      continue;
    }
    V* out = reinterpret_cast<V*>(dst + d * g.row_bytes) + v;
    int64_t at = static_cast<int64_t>(idx[r]) * g.row_bytes;
    if (by_table && (at = TableRowOffset(g, table, idx[r], arena_blocks)) < 0) {
      *out = V{};
      if (v == 0 && g.errors != nullptr) atomicAdd(g.errors, 1);
      continue;
    }
    *out = reinterpret_cast<const V*>(src + at)[v];
  }
}

template <typename V>
__global__ void RowTableKernel(const void* const* rows, int64_t n, int64_t row_bytes,
                               int64_t rows_per_block, char* dst) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t count = Min64(rows_per_block, n - first);
  if (count <= 0) return;
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t t = threadIdx.x; t < count * vecs; t += blockDim.x) {
    const int64_t r = t / vecs, v = t % vecs;
    reinterpret_cast<V*>(dst + (first + r) * row_bytes)[v] =
        reinterpret_cast<const V*>(rows[first + r])[v];
  }
}

template <typename V>
__global__ void ScatterKernel(const char* src, int64_t src_seq_stride, int64_t row_bytes,
                              const int32_t* rows, char* dst, int64_t dst_seq_stride,
                              int64_t dst_head_stride) {
  const int g = blockIdx.x, b = blockIdx.y;
  const V* s = reinterpret_cast<const V*>(src + b * src_seq_stride + g * row_bytes);
  V* d = reinterpret_cast<V*>(dst + b * dst_seq_stride + g * dst_head_stride +
                              static_cast<int64_t>(rows[b]) * row_bytes);
  for (int64_t v = threadIdx.x; v < row_bytes / static_cast<int64_t>(sizeof(V)); v += blockDim.x) {
    d[v] = s[v];
  }
}

// The widest access (16, 8, 4 or 2 bytes) that divides every address and stride.
int Width(std::initializer_list<int64_t> values) {
  int64_t all = 0;
  for (int64_t v : values) all |= v;
  for (int w : {16, 8, 4, 2}) {
    if (all % w == 0) return w;
  }
  return 0;
}

}  // namespace

cudaError_t RunGather(const Gather& g, cudaStream_t stream) {
  const int64_t max_count = g.max_count > 0 ? g.max_count : g.count;
  if (g.batch <= 0 || g.num_kv_heads <= 0 || max_count <= 0) return cudaSuccess;
  const int w = Width({reinterpret_cast<int64_t>(g.src), reinterpret_cast<int64_t>(g.dst),
                       g.row_bytes, g.src_seq_stride, g.src_head_stride, g.block_bytes});
  if (w == 0 || g.row_bytes <= 0) return cudaErrorInvalidValue;
  if (g.tables != nullptr && (g.table_rows <= 0 || g.table_capacity <= 0 || g.block_bytes <= 0)) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows_per_block = std::max<int64_t>(1, kBytesPerBlock / g.row_bytes);
  const dim3 grid(Blocks(max_count, static_cast<int>(rows_per_block)), g.num_kv_heads, g.batch);
  switch (w) {
    case 16:
      GatherKernel<uint4><<<grid, kThreads, 0, stream>>>(g, rows_per_block);
      break;
    case 8:
      GatherKernel<uint2><<<grid, kThreads, 0, stream>>>(g, rows_per_block);
      break;
    case 4:
      GatherKernel<uint32_t><<<grid, kThreads, 0, stream>>>(g, rows_per_block);
      break;
    default:
      GatherKernel<uint16_t><<<grid, kThreads, 0, stream>>>(g, rows_per_block);
  }
  return cudaGetLastError();
}

cudaError_t GatherRowTable(const void* const* rows, int64_t n, int64_t row_bytes, int64_t align,
                           void* dst, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int w = Width({align, row_bytes, reinterpret_cast<int64_t>(dst)});
  if (w == 0 || row_bytes <= 0) return cudaErrorInvalidValue;
  const int64_t rows_per_block = std::max<int64_t>(1, kBytesPerBlock / row_bytes);
  const int blocks = Blocks(n, static_cast<int>(rows_per_block));
  auto* d = static_cast<char*>(dst);
  switch (w) {
    case 16:
      RowTableKernel<uint4><<<blocks, kThreads, 0, stream>>>(rows, n, row_bytes, rows_per_block, d);
      break;
    case 8:
      RowTableKernel<uint2><<<blocks, kThreads, 0, stream>>>(rows, n, row_bytes, rows_per_block, d);
      break;
    case 4:
      RowTableKernel<uint32_t>
          <<<blocks, kThreads, 0, stream>>>(rows, n, row_bytes, rows_per_block, d);
      break;
    default:
      RowTableKernel<uint16_t>
          <<<blocks, kThreads, 0, stream>>>(rows, n, row_bytes, rows_per_block, d);
  }
  return cudaGetLastError();
}

cudaError_t ScatterRows(const void* src, int64_t src_seq_stride, int batch, int num_kv_heads,
                        int64_t row_bytes, const int32_t* rows, void* dst, int64_t dst_seq_stride,
                        int64_t dst_head_stride, cudaStream_t stream) {
  const int w = Width({reinterpret_cast<int64_t>(src), reinterpret_cast<int64_t>(dst), row_bytes,
                       src_seq_stride, dst_seq_stride, dst_head_stride});
  if (w == 0) return cudaErrorInvalidValue;
  if (batch <= 0 || num_kv_heads <= 0) return cudaSuccess;
  const dim3 grid(num_kv_heads, batch);
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  switch (w) {
    case 16:
      ScatterKernel<uint4><<<grid, 64, 0, stream>>>(s, src_seq_stride, row_bytes, rows, d,
                                                    dst_seq_stride, dst_head_stride);
      break;
    case 8:
      ScatterKernel<uint2><<<grid, 64, 0, stream>>>(s, src_seq_stride, row_bytes, rows, d,
                                                    dst_seq_stride, dst_head_stride);
      break;
    case 4:
      ScatterKernel<uint32_t><<<grid, 64, 0, stream>>>(s, src_seq_stride, row_bytes, rows, d,
                                                       dst_seq_stride, dst_head_stride);
      break;
    default:
      ScatterKernel<uint16_t><<<grid, 64, 0, stream>>>(s, src_seq_stride, row_bytes, rows, d,
                                                       dst_seq_stride, dst_head_stride);
  }
  return cudaGetLastError();
}

}  // namespace infinigen::cuda
