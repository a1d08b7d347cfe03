// CUDA operations: the device counterparts of kernels/cpu/ops.h, plus the pieces of an InfiniGen
// decode step that run on the GPU (speculation scores, selection, the gather from host memory)
// and device sampling. Storage is f32, f16 or bf16; every kernel accumulates in f32.
//
// Every function enqueues work on `stream` and returns the launch's cudaError_t (cudaSuccess, or
// cudaErrorInvalidValue for a shape a kernel does not support). Nothing here allocates: callers
// size workspaces with the *WorkspaceBytes functions beforehand. All pointers are device
// pointers unless a comment says "host-mapped" (pinned host memory with a device address).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace infinigen::cuda {

// Element types; the values equal infinigen::DType's.
enum class Elem : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
constexpr size_t ElemSize(Elem e) { return e == Elem::kF32 ? 4 : 2; }

// A row-major matrix: row r starts at data + r * stride elements.
struct Mat {
  void* data = nullptr;
  Elem type = Elem::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;
};

// ---- elementwise (elementwise.cu) ----

// out[i, :] = table[ids[i], :] (table: [vocab, out.cols] of table_type).
cudaError_t Embedding(const void* table, Elem table_type, const int32_t* ids, Mat out,
                      cudaStream_t stream);
// Per row: out = x / sqrt(mean(x^2) + eps) * weight. out may alias x.
cudaError_t RmsNorm(Mat x, const float* weight, float eps, Mat out, cudaStream_t stream);
// Per row: out = (x - mean) / sqrt(var + eps) * weight + bias (weight/bias may be null).
cudaError_t LayerNorm(Mat x, const float* weight, const float* bias, float eps, Mat out,
                      cudaStream_t stream);
// Rotates the first rotary_dim channels of each of num_heads heads of every row in place.
// positions: [x.rows]; inv_freq: [rotary_dim / 2]. interleaved: pairs (2i, 2i+1), else (i, i+r/2).
// inv_freq_head_stride: head h turns by inv_freq + h * stride (0: one table for every head).
cudaError_t Rope(Mat x, int num_heads, int head_dim, int rotary_dim, const int32_t* positions,
                 const float* inv_freq, bool interleaved, cudaStream_t stream,
                 int64_t inv_freq_head_stride = 0);
// out = silu(gate) * up.
cudaError_t SwiGlu(Mat gate, Mat up, Mat out, cudaStream_t stream);
cudaError_t Relu(Mat x, cudaStream_t stream);
// y += x.
cudaError_t Add(Mat x, Mat y, cudaStream_t stream);
// y[r, :] += bias (f32, [y.cols]).
cudaError_t AddBias(const float* bias, Mat y, cudaStream_t stream);
// dst = src, converting the element type when they differ.
cudaError_t Copy(Mat src, Mat dst, cudaStream_t stream);

// Fills n elements with uniform values in [-scale, scale) from a counter hash of (seed, index):
// random weights and caches for benchmarks and tests. `data` may be host-mapped.
cudaError_t FillRandom(void* data, Elem type, int64_t n, uint64_t seed, float scale,
                       cudaStream_t stream);

// ---- attention (attention.cu) ----

// K or V rows: row j of KV head g at data + g * head_stride + j * row_stride elements.
struct KvMat {
  const void* data = nullptr;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
};

// Causal attention of q's rows (positions q_start ..) over K/V rows 0 .. q_start + q.rows - 1,
// tiled through shared memory. q, out: [rows, num_heads * head_dim]; K/V of q.type.
// head_dim <= 256; GQA: query head h reads KV head h / (num_heads / num_kv_heads).
cudaError_t AttentionCausal(Mat q, int64_t q_start, KvMat k, KvMat v, int num_heads,
                            int num_kv_heads, int head_dim, float scale, Mat out,
                            cudaStream_t stream);

// The softmax step of a prefill through GEMMs (CudaBackend::AttentionCausal on long prompts):
// row i of the float32 scores `s` ([rows, cols], row stride s_stride; query position
// first_pos + i against keys 0 .. cols-1) becomes softmax(scale * s) over the keys at or before
// that position and 0 after it, written to p (rows x cols of p.type, row stride p.stride).
cudaError_t CausalSoftmax(const float* s, int64_t s_stride, int64_t rows, int64_t cols,
                          int64_t first_pos, float scale, Mat p, cudaStream_t stream);

// One sequence of a DecodeAttention given by `seqs`: where its query, K, V, row lists and
// output are, its row count, and its own split of the rows (DecodeSplitFor), so that its result
// is what a launch of it alone gives.
struct DecodeSeq {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* indices = nullptr;  // head g's at indices + g * index_head_stride; null: 0 ..
  void* out = nullptr;
  int64_t head_stride = 0, index_head_stride = 0;
  int32_t num_rows = 0, splits = 1, rows_per_split = 1;
  // The rows attended, in device memory: min(*count, num_rows) (null: num_rows); the split is
  // num_rows's, so that it is known when the launch is made.
  const int32_t* count = nullptr;
};

// Decode attention of one query row per sequence over a list of rows per KV head, plus
// (optionally) the current token's own K/V. Split over the rows (flash-decoding) and combined.
struct DecodeAttention {
  Elem type = Elem::kBF16;  // of q, K, V, the current K/V and out
  int batch = 1, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  float scale = 1.0f;
  const void* q = nullptr;  // [batch] rows of num_heads * head_dim, q_seq_stride apart
  int64_t q_seq_stride = 0;
  // Rows of sequence b: K at k + b * kv_seq_stride (then KvMat's strides), same for V.
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t kv_seq_stride = 0, head_stride = 0, row_stride = 0;
  // Row lists: head g of sequence b reads rows indices[b * index_seq_stride + g *
  // index_head_stride + j] for j < its row count; null: rows 0 .. count - 1.
  const int32_t* indices = nullptr;
  int64_t index_seq_stride = 0, index_head_stride = 0;
  // Row count per sequence: num_rows_per_seq[b] (device) when given, else num_rows. max_rows
  // bounds the counts (it sizes the split); 0 means num_rows.
  int32_t num_rows = 0;
  const int32_t* num_rows_per_seq = nullptr;
  int32_t max_rows = 0;
  // The current token's K and V ([num_kv_heads * head_dim] per sequence), attended after the
  // listed rows; null: none.
  const void* k_cur = nullptr;
  const void* v_cur = nullptr;
  int64_t cur_seq_stride = 0;
  void* out = nullptr;  // [batch] rows of num_heads * head_dim
  int64_t out_seq_stride = 0;
  // Attention probabilities [num_heads, num_rows] (batch 1, without a current token or per-sequence
  // counts, only).
  float* weights = nullptr;
  void* workspace = nullptr;  // DecodeAttentionWorkspaceBytes(*this)
  // Per sequence instead (device [batch]; no weights, no current K/V): each sequence's pointers,
  // count and split as DecodeSeq says (row_stride shared); max_splits the most of one.
  const DecodeSeq* seqs = nullptr;
  int32_t max_splits = 0;
};
size_t DecodeAttentionWorkspaceBytes(const DecodeAttention& a);
// The most DecodeAttentionWorkspaceBytes is for `batch` sequences of this shape, whatever their
// rows (a launch's splits, or each sequence's own, are at most the target blocks per KV head).
size_t DecodeAttentionWorkspaceBound(int batch, int num_heads, int num_kv_heads, int head_dim);
// The split a launch of one sequence of `num_rows` rows alone makes (batch 1, no current K/V).
void DecodeSplitFor(int num_kv_heads, int64_t num_rows, int32_t* splits, int32_t* rows_per_split);
cudaError_t RunDecodeAttention(const DecodeAttention& a, cudaStream_t stream);

// ---- InfiniGen selection (selection.cu) ----

// out[b, h, c] = sum_i x[b, h, i] * a[h / group, i, c]: heads of x projected on the partial
// skew A[:, P] ([num_kv_heads, head_dim, partial_dim], f32). x: [batch] rows of num_heads *
// head_dim of x_type, x_seq_stride apart; out[b, h, :] (out_type) at out + b * out_seq_stride
// + h * out_head_stride elements (the speculated query, or a row of the partial key cache).
struct PartialProjection {
  Elem x_type = Elem::kBF16;
  const void* x = nullptr;
  int64_t x_seq_stride = 0;
  int batch = 1, num_heads = 0, num_kv_heads = 0, head_dim = 0, partial_dim = 0;
  const float* skew = nullptr;
  Elem out_type = Elem::kF32;
  void* out = nullptr;
  // Channel c of (row b, head h) at out + b * out_seq_stride + h * out_head_stride + c *
  // out_channel_stride.
  int64_t out_seq_stride = 0, out_head_stride = 0, out_channel_stride = 1;
};
cudaError_t RunPartialProjection(const PartialProjection& p, cudaStream_t stream);

// The speculation's limits: partial channels a head, and query heads a KV head (the partial
// queries of a group are held in shared memory).
inline constexpr int kMaxSpeculationPartialDim = 128;
inline constexpr int kMaxSpeculationGroup = 8;

// The speculation of one layer for a batch: scores of every stored row against the partial
// query, the per-sequence budget, the group attention mass, and the top rows per KV head.
struct Speculation {
  int batch = 1, num_heads = 0, num_kv_heads = 0, partial_dim = 0;
  float scale = 1.0f;
  const float* q_partial = nullptr;  // [batch, num_heads, partial_dim]
  // Partial keys of sequence b, KV head g, row j, channel c at keys + b * key_seq_stride + g *
  // key_head_stride + j * key_row_stride + c * key_channel_stride (key_type); a row stride of
  // 0 means partial_dim (rows of contiguous channels).
  Elem key_type = Elem::kBF16;
  const void* keys = nullptr;
  int64_t key_seq_stride = 0, key_head_stride = 0, key_row_stride = 0, key_channel_stride = 1;
  const int32_t* num_rows = nullptr;  // [batch] stored rows per sequence (null: max_rows each)
  int32_t max_rows = 0;               // bound of num_rows (sizes the launch)
  // Budget: k = clamp(round(mean over heads of #{s > max - alpha}), min(k_min, k_max), k_max)
  // with k_max = max(1, floor(budget_fraction * n)) (and never above n).
  // k_max > 0 replaces the fraction's bound (min(k_max, n)). `margin` adds the prefetch margin
  // 1 + max(2, k / 16) to k (at most n); `force_last` always chooses row n - 1 (the current
  // token). The count rounds half away from zero, as the host's does.
  float alpha = 4.0f;
  float budget_fraction = 0.2f;
  int32_t k_min = 0;
  int64_t k_max = 0;
  bool margin = false, force_last = false;
  // Outputs: the chosen rows of (b, g), ascending, at indices + (b * num_kv_heads + g) *
  // index_capacity; counts[b] = k of sequence b. index_capacity >= budget of max_rows.
  int32_t* indices = nullptr;
  int64_t index_capacity = 0;
  int32_t* counts = nullptr;
  void* workspace = nullptr;  // SpeculationWorkspaceBytes(*this)
};
size_t SpeculationWorkspaceBytes(const Speculation& s);
// The budget's upper bound for n rows (what index_capacity must hold).
int64_t SpeculationMaxBudget(float budget_fraction, int64_t n);
cudaError_t RunSpeculation(const Speculation& s, cudaStream_t stream);

// Per KV head of one score matrix: the `k` largest values of scores[g, 0..n), rows ascending
// into out[g, 0..k) (ties to the lower row). No full sort: a 4-pass radix select, then an
// order-preserving compaction. scores: [num_kv_heads, n] f32; k <= n.
cudaError_t TopK(const float* scores, int num_kv_heads, int64_t n, int64_t k, int32_t* out,
                 cudaStream_t stream);

// ---- gather from host memory (gather.cu) ----

// Copies rows of a host-resident K or V cache into packed device staging: for sequence b, KV
// head g and j < counts[b] (or count), row indices[(b * num_kv_heads + g) * index_capacity + j]
// of src (host-mapped: src + b * src_seq_stride + g * src_head_stride + row * row_bytes) to
// dst + ((b * num_kv_heads + g) * dst_rows_per_head + j) * row_bytes. Reads the host memory
// directly over the link, 16 bytes at a time where alignment allows.
struct Gather {
  int batch = 1, num_kv_heads = 0;
  int64_t row_bytes = 0;
  const void* src = nullptr;
  int64_t src_seq_stride = 0, src_head_stride = 0;  // bytes
  const int32_t* indices = nullptr;
  int64_t index_capacity = 0;
  const int32_t* counts = nullptr;       // [batch]; null: `count` rows for every sequence
  const int32_t* list_counts = nullptr;  // [batch * num_kv_heads], instead of counts
  int64_t count = 0;
  int64_t max_count = 0;  // bound of the counts (sizes the launch); 0 means count
  void* dst = nullptr;
  int64_t dst_rows_per_head = 0;
  // Where row j of list l lands within the list's dst rows: dst_rows[l * index_capacity + j]
  // (device; null: row j). One outside [0, dst_rows_per_head) is not written and adds one to
  // *errors where errors is set.
  const int32_t* dst_rows = nullptr;
  // Block-table addressing (tables non-null; src is then an arena, src_bytes long, and the
  // strides are unused): row index s of list l lives at src + tables[l * table_capacity + s /
  // table_rows] * block_bytes + (s % table_rows) * row_bytes. A row whose slot or block falls
  // outside the table or the arena is written as zeros, and a count above max_count is taken as
  // max_count; each adds one to *errors where errors is set (the layout and checks of the
  // backend's BlockRowsGather, gpu_worker/backend/backend.h).
  const int32_t* tables = nullptr;
  int64_t table_capacity = 0, table_rows = 0, block_bytes = 0, src_bytes = 0;
  int32_t* errors = nullptr;
};
cudaError_t RunGather(const Gather& g, cudaStream_t stream);

// Copies n rows of row_bytes each to dst + i * row_bytes (device memory), row i from rows[i]:
// addresses the device can read (device memory, or host memory registered and mapped, by its
// device alias); `rows` itself in device memory. `align`: a multiple of every address in
// `rows` (the widest access used is the largest of 16, 8, 4, 2 dividing it, row_bytes and dst).
cudaError_t GatherRowTable(const void* const* rows, int64_t n, int64_t row_bytes, int64_t align,
                           void* dst, cudaStream_t stream);

// Writes one row per (sequence, KV head) from device rows src[b * src_seq_stride + g * row_bytes]
// to dst (host-mapped or device) at dst + b * dst_seq_stride + g * dst_head_stride + rows[b] *
// row_bytes: the decode step's append of the current token to a host KV cache.
cudaError_t ScatterRows(const void* src, int64_t src_seq_stride, int batch, int num_kv_heads,
                        int64_t row_bytes, const int32_t* rows, void* dst, int64_t dst_seq_stride,
                        int64_t dst_head_stride, cudaStream_t stream);

// ---- rows kept between steps (kept_rows.cu) ----

// The backend's KeptRowsPlan and KeptRowsMap (gpu_worker/backend/backend.h says what they do),
// one thread block per KV head. Lists: head g's first min(*count, max_count) (count null:
// max_count) of slots + g * capacity (slots null: 0, 1, ...).
struct KeptRowsArgs {
  int num_kv_heads = 0;
  int32_t* row_of = nullptr;
  int64_t map_capacity = 0;
  int32_t* slot_of = nullptr;
  int64_t rows = 0;
  const int32_t* slots = nullptr;
  const int32_t* count = nullptr;
  int64_t capacity = 0, max_count = 0;
  int32_t* errors = nullptr;
};
cudaError_t PlanKeptRows(const KeptRowsArgs& k, bool keep, int32_t* move_slots, int32_t* move_rows,
                         int32_t* move_counts, int32_t* listed, int32_t* workspace,
                         cudaStream_t stream);
cudaError_t MapKeptRows(const KeptRowsArgs& k, int64_t head_rows, int64_t current_slot,
                        int64_t current_row, int64_t miss_row, int64_t miss_capacity, int32_t* out,
                        int32_t* miss_slots, int32_t* miss_counts, cudaStream_t stream);

// ---- sampling (sampling.cu) ----

// tokens[r] = argmax of logits row r (f32, [rows, vocab]); ties to the lowest id.
cudaError_t Argmax(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                   cudaStream_t stream);

// Sampling of one token per row, as kernels/cpu/sampling.h does it (temperature, then top-k
// keeping every token tied with the k-th, top-p, min-p, one Philox draw keyed by (seed,
// position)), for 1 <= top_k <= kMaxSampleTopK (ties beyond 2 * kMaxSampleTopK candidates are
// dropped). No repetition penalty: apply it to the logits first.
constexpr int kMaxSampleTopK = 256;
struct Sample {
  const float* logits = nullptr;  // [rows, vocab]
  int64_t rows = 0, vocab = 0;
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f, min_p = 0.0f;
  const uint64_t* seeds = nullptr;      // [rows]
  const uint64_t* positions = nullptr;  // [rows]
  int32_t* tokens = nullptr;            // [rows]
};
cudaError_t RunSample(const Sample& s, cudaStream_t stream);

}  // namespace infinigen::cuda
