// Rows kept in device memory between decode steps, planned there: which listed slots a prefetch
// moves and into which free rows (PlanKeptRows), and a choice's slots as the rows attention reads
// (MapKeptRows). One thread block per KV head walks its lists in chunks of the block's threads;
// a block-wide prefix sum gives every chunk's misses and free rows their places in list order,
// so the rows chosen are exactly those of the CPU backend's plain loops (cpu_kept_rows.cc).
#include "kernels/cuda/common.cuh"

namespace infinigen::cuda {
namespace {

// A block of 1024: a head's lists (thousands of slots at 32K tokens) in fewer serial chunks.
constexpr int kThreads = 1024;

// Exclusive prefix sum of `v` over the block (kThreads threads); *total gets the sum. Every
// thread of the block must call it.
__device__ int BlockExclusiveSum(int v, int* total) {
  __shared__ int warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kThreads / 32 ? warp_sums[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kThreads / 32) warp_sums[lane] = w;
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[kThreads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

__device__ int64_t ListCount(const KeptRowsArgs& k, int g) {
  int64_t n = k.count != nullptr ? *k.count : k.max_count;
  if (n > k.max_count) {
    if (g == 0 && threadIdx.x == 0 && k.errors != nullptr) atomicAdd(k.errors, 1);
    n = k.max_count;
  }
  return Max64(n, 0);
}

__device__ int32_t ListSlot(const KeptRowsArgs& k, int g, int64_t j) {
  return k.slots != nullptr ? k.slots[g * k.capacity + j] : static_cast<int32_t>(j);
}

// Whether s is among head g's first n slots (ascending).
__device__ bool Lists(const KeptRowsArgs& k, int g, int32_t s, int64_t n) {
  if (k.slots == nullptr) return s >= 0 && s < n;
  const int32_t* list = k.slots + g * k.capacity;
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (list[mid] < s) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < n && list[lo] == s;
}

__global__ void __launch_bounds__(kThreads)
    PlanKernel(KeptRowsArgs k, bool keep, int32_t* move_slots, int32_t* move_rows,
               int32_t* move_counts, int32_t* listed, int32_t* workspace) {
  const int g = blockIdx.x;
  const int64_t n = ListCount(k, g);
  int32_t* row_of = k.row_of + g * k.map_capacity;
  int32_t* slot_of = k.slot_of + g * k.rows;
  // Kept rows whose slots are not listed are freed.
  for (int64_t r = threadIdx.x; r < k.rows; r += kThreads) {
    const int32_t s = slot_of[r];
    if (s < 0 || (keep && Lists(k, g, s, n))) continue;
    if (s < k.map_capacity) row_of[s] = -1;
    slot_of[r] = -1;
  }
  __syncthreads();
  // The free rows, lowest first.
  int32_t* free_rows = workspace + g * k.rows;
  int free = 0;
  for (int64_t base = 0; base < k.rows; base += kThreads) {
    const int64_t r = base + threadIdx.x;
    const int is_free = r < k.rows && slot_of[r] < 0;
    int total;
    const int at = BlockExclusiveSum(is_free, &total);
    if (is_free) free_rows[free + at] = static_cast<int32_t>(r);
    free += total;
  }
  __syncthreads();
  // Each listed slot not held, in list order, takes the next free row.
  int missed = 0;
  for (int64_t base = 0; base < n; base += kThreads) {
    const int64_t j = base + threadIdx.x;
    const int32_t s = j < n ? ListSlot(k, g, j) : -1;
    const bool in_map = j < n && s >= 0 && s < k.map_capacity;
    if (j < n && !in_map && k.errors != nullptr) atomicAdd(k.errors, 1);
    const int miss = in_map && row_of[s] < 0;
    int total;
    const int at = missed + BlockExclusiveSum(miss, &total);
    if (miss) {
      if (at < free) {
        const int32_t r = free_rows[at];
        row_of[s] = r;
        slot_of[r] = s;
        move_slots[g * k.capacity + at] = s;
        move_rows[g * k.capacity + at] = r;
      } else if (k.errors != nullptr) {
        atomicAdd(k.errors, 1);
      }
    }
    missed += total;
  }
  if (threadIdx.x == 0) {
    move_counts[g] = missed < free ? missed : free;
    if (listed != nullptr) listed[g] = static_cast<int32_t>(n);
  }
}

__global__ void __launch_bounds__(kThreads)
    MapKernel(KeptRowsArgs k, int64_t head_rows, int64_t current_slot, int64_t current_row,
              int64_t miss_row, int64_t miss_capacity, int32_t* out, int32_t* miss_slots,
              int32_t* miss_counts) {
  const int g = blockIdx.x;
  const int64_t n = ListCount(k, g);
  const int32_t* row_of = k.row_of + g * k.map_capacity;
  const int64_t first = g * head_rows;
  const int32_t current = static_cast<int32_t>(current_row + g - first);
  int misses = 0;
  for (int64_t base = 0; base < n; base += kThreads) {
    const int64_t j = base + threadIdx.x;
    const int32_t s = j < n ? ListSlot(k, g, j) : -1;
    int32_t row = -1;
    if (j < n && s == current_slot) {
      row = current;
    } else if (j < n && s >= 0 && s < k.map_capacity) {
      row = row_of[s];
    }
    const int miss = j < n && s != current_slot && row < 0;  // the current row is never one
    int total;
    const int at = misses + BlockExclusiveSum(miss, &total);
    if (miss) {
      if (at < miss_capacity) {
        miss_slots[g * k.capacity + at] = s;
        row = static_cast<int32_t>(miss_row + g * miss_capacity + at - first);
      } else {
        if (k.errors != nullptr) atomicAdd(k.errors, 1);
        row = current;
      }
    }
    if (j < n) out[g * k.capacity + j] = row;
    misses += total;
  }
  if (threadIdx.x == 0) miss_counts[g] = misses < miss_capacity ? misses : miss_capacity;
}

}  // namespace

cudaError_t PlanKeptRows(const KeptRowsArgs& k, bool keep, int32_t* move_slots, int32_t* move_rows,
                         int32_t* move_counts, int32_t* listed, int32_t* workspace,
                         cudaStream_t stream) {
  if (k.num_kv_heads <= 0) return cudaSuccess;
  PlanKernel<<<k.num_kv_heads, kThreads, 0, stream>>>(k, keep, move_slots, move_rows, move_counts,
                                                      listed, workspace);
  return cudaGetLastError();
}

cudaError_t MapKeptRows(const KeptRowsArgs& k, int64_t head_rows, int64_t current_slot,
                        int64_t current_row, int64_t miss_row, int64_t miss_capacity, int32_t* out,
                        int32_t* miss_slots, int32_t* miss_counts, cudaStream_t stream) {
  if (k.num_kv_heads <= 0) return cudaSuccess;
  MapKernel<<<k.num_kv_heads, kThreads, 0, stream>>>(k, head_rows, current_slot, current_row,
                                                     miss_row, miss_capacity, out, miss_slots,
                                                     miss_counts);
  return cudaGetLastError();
}

}  // namespace infinigen::cuda
