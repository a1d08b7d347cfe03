// Backend: the only part of the worker that knows about the device. Model code is written once
// against this interface; CpuBackend (the reference) and CudaBackend implement it.
//
// Memory: Allocate() returns device memory owned by a Buffer. Compute takes non-owning views
// (MatView, KvView) of that memory. Operations may run asynchronously on the backend's stream;
// Synchronize() waits for them and reports the first error. Nothing here allocates in an
// operation, so a decode step allocates nothing once its workspace exists.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "kernels/cpu/ops.h"

namespace infinigen {

// Device memory; freed by the destructor.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual void* data() = 0;
  virtual size_t size() const = 0;
};

// A row-major matrix in device memory: row r starts at data + r * stride elements.
struct MatView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;

  MatView Rows(int64_t begin, int64_t count) const {
    return {static_cast<uint8_t*>(data) + begin * stride * DTypeSize(dtype), dtype, count, cols,
            stride};
  }
  MatView Cols(int64_t begin, int64_t count) const {
    return {static_cast<uint8_t*>(data) + begin * DTypeSize(dtype), dtype, rows, count, stride};
  }
  template <typename T>
  T* As() const {
    return static_cast<T*>(data);
  }
};

// K or V rows of one layer of one sequence: row j of KV head g starts at
// data + (g * head_stride + j * row_stride) elements. A row table instead (`rows` set, `data`
// unused): row j of head g starts at rows[g * head_stride + j * row_stride], which lets a
// backend whose memory is host memory attend over rows where they lie (the KV store's arena,
// the step's own activations) without packing them first. Only AttentionDecode of backends
// with host_accessible() memory reads row tables; the rest reject them.
struct KvView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
  const void** rows = nullptr;

  // Rows [begin, begin + count) of KV head g as a matrix.
  MatView Head(int64_t g, int64_t begin, int64_t count, int64_t head_dim) const {
    return {static_cast<uint8_t*>(data) + (g * head_stride + begin * row_stride) * DTypeSize(dtype),
            dtype, count, head_dim, row_stride};
  }
};

struct AttentionShape {
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float scale = 1.0f;  // multiplies q·k
};

// How a backend stores a weight matrix. Vectors (norms, biases) are always float32.
enum class WeightFormat : uint8_t {
  kF32,
  kF16,
  kBF16,
  kQ8,  // int8 with one float32 scale per 32 weights of a row (kernels/cpu/packed_gemm.h)
  // A GGUF file's 4- and 5-bit matrices kept as the file has them: GGUF's Q4_1
  // (kernels/cpu/q4_1.h) for Q4_0, Q4_1 and Q4_K, Q5_1 (kernels/cpu/q5_1.h) for Q5_0, Q5_1 and
  // Q5_K, Q6_K (kernels/cpu/q6_k.h) for Q6_K; q8 for every other matrix. As an option, what a
  // backend keeps; as a weight's format, one in Q4_1 blocks.
  kQ4_1,
  // A weight in Q5_1 blocks (chosen per matrix under kQ4_1, never as an option).
  kQ5_1,
  // A file's Q6_K matrix in the CPU's Q6_K layout (kernels/cpu/q6_k.h; chosen per matrix under
  // kQ4_1, never as an option).
  kQ6_K,
  // A file's Q5_0 matrix in Q5_1 blocks that keep no minimums (each is -16 times the block's
  // scale; kernels/cpu/q5_1.h): 24 bytes a block, not 28 (chosen per matrix under kQ4_1).
  kQ5_0,
  // A file's Q4_0 matrix in Q4_1 blocks that keep no minimums (each is -8 times the block's
  // scale; kernels/cpu/q4_1.h): 20 bytes a block, not 24 (chosen per matrix under kQ4_1).
  kQ4_0,
};
const char* WeightFormatName(WeightFormat f);

// A weight matrix [rows, cols] as a checkpoint stores it, which a backend reads a block of rows
// at a time, so that no float32 copy of a whole matrix is made while loading.
class StoredWeight {
 public:
  virtual ~StoredWeight() = default;
  virtual int64_t rows() const = 0;
  virtual int64_t cols() const = 0;
  // Rows [r0, r1) decoded to float32, row-major into out.
  virtual void Decode(int64_t r0, int64_t r1, float* out) const = 0;
  // Whether every value converts exactly to Q4_1 blocks of 32 (kernels/cpu/q4_1.h: the file's
  // Q4_0, Q4_1 and Q4_K blocks; none by default), and rows [r0, r1) so converted, blocks in row
  // order (called only when ConvertsToQ4_1()).
  virtual bool ConvertsToQ4_1() const { return false; }
  virtual void ToQ4_1(int64_t /*r0*/, int64_t /*r1*/, uint8_t* /*qs*/, float* /*d*/,
                      float* /*m*/) const {}
  // Whether those Q4_1 blocks' minimums are all -8 times their scales (the file's Q4_0): ToQ4_1
  // then takes m = nullptr and writes none.
  virtual bool ConvertsToQ4_0() const { return false; }
  // The same for Q5_1 blocks (kernels/cpu/q5_1.h: the Q4_1 ones and the file's Q5_0, Q5_1 and
  // Q5_K blocks).
  virtual bool ConvertsToQ5_1() const { return false; }
  virtual void ToQ5_1(int64_t /*r0*/, int64_t /*r1*/, uint8_t* /*qs*/, uint32_t* /*qh*/,
                      float* /*d*/, float* /*m*/) const {}
  // Whether those Q5_1 blocks' minimums are all -16 times their scales (the file's Q5_0): ToQ5_1
  // then takes m = nullptr and writes none.
  virtual bool ConvertsToQ5_0() const { return false; }
  // The same for the CPU's Q6_K layout (kernels/cpu/q6_k.h: the file's Q6_K super-blocks; rows
  // of whole super-blocks).
  virtual bool ConvertsToQ6_K() const { return false; }
  virtual void ToQ6_K(int64_t /*r0*/, int64_t /*r1*/, uint8_t* /*ql*/, uint8_t* /*qh*/,
                      int8_t* /*s*/, float* /*d*/) const {}
  // Where the matrix's parts end (row counts, ascending; the last is rows()), for a matrix
  // stacked from tensors that may be stored alike or not (a fused QKV whose V a file keeps in
  // more bits): {rows()} by default. Rows(r0, r1) views the rows of whole parts (r0 and r1 part
  // ends, or 0), nullptr for other ranges or by default.
  virtual std::vector<int64_t> PartEnds() const { return {rows()}; }
  virtual std::unique_ptr<StoredWeight> Rows(int64_t /*r0*/, int64_t /*r1*/) const {
    return nullptr;
  }
};
absl::StatusOr<WeightFormat> ParseWeightFormat(absl::string_view name);

// A weight in the backend's storage format. Matrices are [rows = out_features, cols =
// in_features]; vectors have rows = 1.
struct Weight {
  std::unique_ptr<Buffer> buffer;
  WeightFormat format = WeightFormat::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  // Or, with no buffer of its own, consecutive row ranges stored in different formats (the CPU
  // backend's fused matrices whose parts a file keeps in different block formats): Linear
  // multiplies each into its columns of the output.
  std::vector<Weight> segments;

  explicit operator bool() const { return buffer != nullptr || !segments.empty(); }
  const void* data() const { return buffer ? buffer->data() : nullptr; }
};

// What a backend was asked to do that costs more than launching work: allocations, copies between
// host and backend memory, and waits for the device (a copy to the host waits too). A decode step
// on a GPU should do none of them once its workspaces exist (docs/cuda.md).
struct BackendCounters {
  int64_t allocations = 0;
  int64_t copies_to_device = 0;
  int64_t copies_to_host = 0;
  int64_t synchronizations = 0;

  BackendCounters operator-(const BackendCounters& o) const {
    return {allocations - o.allocations, copies_to_device - o.copies_to_device,
            copies_to_host - o.copies_to_host, synchronizations - o.synchronizations};
  }
  BackendCounters& operator+=(const BackendCounters& o) {
    allocations += o.allocations;
    copies_to_device += o.copies_to_device;
    copies_to_host += o.copies_to_host;
    synchronizations += o.synchronizations;
    return *this;
  }
};

// InfiniGen's partial key cache of one (sequence, layer) in backend memory: bfloat16,
// channel-major per KV head (channel c of head g, row j at (g * partial_dim + c) * capacity +
// j), so that scoring reads each channel of consecutive rows contiguously. Bytes():
// num_kv_heads * partial_dim * capacity * 2.
struct PartialKeysShape {
  int num_kv_heads = 0, head_dim = 0, partial_dim = 0;
  int64_t capacity = 0;
  size_t Bytes() const {
    return static_cast<size_t>(num_kv_heads) * partial_dim * static_cast<size_t>(capacity) * 2;
  }
};

// One decode token's choice of rows over a partial key cache (INFINIGEN.md, decode steps 2-5;
// kernels/cpu/selection.h ChooseRows is the reference): scores of the speculated partial query
// against rows [0, rows), k = the mean over heads of the rows within alpha of the head's best,
// clamped to [min(k_min, k_max), k_max] (plus the prefetch margin with `margin`, at most rows),
// and per KV head the top k rows by group attention mass (row rows - 1, the current token,
// always with `force_last`), ascending.
struct RowChoiceRequest {
  MatView q_partial;  // [1, num_heads * partial_dim], after RoPE and the skew
  const void* keys = nullptr;
  PartialKeysShape keys_shape;
  int num_heads = 0;
  float scale = 1.0f, alpha = 10.0f;
  int64_t rows = 0, k_min = 1, k_max = 1;
  bool margin = false, force_last = false;
  // Outputs in backend memory: rows of KV head g at indices + g * index_capacity (capacity >=
  // k_max, plus the margin with `margin`), and k in *count.
  int32_t* indices = nullptr;
  int64_t index_capacity = 0;
  int32_t* count = nullptr;
};

// A layer's chosen K or V rows of a batch, gathered from host memory by block table: the KV
// store's arena (registered with RegisterHostMemory), with everything that says which rows in
// backend memory, so that a choice made on the device is gathered without the host reading it
// (kv_store/row_copy.h HeadRowsView is the same layout, one list at a time). List l = b *
// num_kv_heads + g (sequence b, KV head g); its row j < counts[b] (counts null: max_count) is slot
// s = slots[l * slot_capacity + j], at arena + tables[l * table_capacity + s / rows_per_block] *
// block_bytes + (s % rows_per_block) * row_bytes, and lands at dst + (l * dst_rows_per_list + d)
// * row_bytes, d = j (dst_rows null) or dst_rows[l * slot_capacity + j] (rows kept between steps
// that a gather fills in where they are free: StoreKvCache's row reuse); rows j >= counts[b] are
// left as they are. A slot outside the table, a block outside the arena, or a count above
// max_count (taken as max_count) adds one to *errors (null: not counted) and gives a row of
// zeros; a d outside [0, dst_rows_per_list) adds one and writes nothing: bad device data cannot
// read outside the arena or write outside dst. With batch or max_count 0 nothing is read, written
// or counted. Rows are of 16-bit or wider elements: row_bytes, block_bytes and the arena and dst
// addresses are even.
struct BlockRowsGather {
  const void* arena = nullptr;
  size_t arena_bytes = 0, block_bytes = 0;
  int64_t rows_per_block = 0, row_bytes = 0;
  int batch = 0, num_kv_heads = 0;
  const int32_t* tables = nullptr;  // [lists, table_capacity] block ids
  int64_t table_capacity = 0;
  const int32_t* slots = nullptr;  // [lists, slot_capacity]
  int64_t slot_capacity = 0;
  const int32_t* counts = nullptr;  // [batch]
  int64_t max_count = 0;            // sizes the work: no count above it is gathered
  int32_t* errors = nullptr;
  void* dst = nullptr;
  int64_t dst_rows_per_list = 0;
  const int32_t* dst_rows = nullptr;  // [lists, slot_capacity]; null: row j at row j
  // A count per list instead ([lists]; counts is then unused): the rows KeptRowsPlan or
  // KeptRowsMap listed to move, a number of their own per KV head.
  const int32_t* list_counts = nullptr;
  // Queued on the backend's side queue (Backend::ForkSideQueue) instead of its own.
  bool on_side_queue = false;
};

// Slots per KV head in backend memory (a choice made there: RowChoiceRequest's indices and
// count): head g's first *count (count null: max_count) entries of slots + g * capacity, each
// head's distinct and ascending (slots null: 0, 1, ...: every row). A count above max_count is
// taken as max_count and counted as an error.
struct DeviceSlotList {
  const int32_t* slots = nullptr;
  const int32_t* count = nullptr;
  int64_t capacity = 0, max_count = 0;
};

// Rows of one (sequence, layer) that backend memory keeps between steps, with the bookkeeping
// in backend memory too (the device's counterpart of ReusedRows, gpu_worker/kv/row_reuse.h): a
// decode step that plans them where its choices lie never reads those choices on the host.
// Per KV head g: row_of[g * map_capacity + s] is the row holding slot s (-1: none), and
// slot_of[g * rows + r] the slot row r holds (-1: free). Both all -1 at first.
struct KeptRows {
  int num_kv_heads = 0;
  int32_t* row_of = nullptr;
  int64_t map_capacity = 0;  // slots
  int32_t* slot_of = nullptr;
  int64_t rows = 0;  // per head
};

// What a prefetch of `list` moves into the kept rows (ReusedRows::Plan's hits and misses; a miss
// takes the lowest free row here, the last freed one there, so rows may differ): first every kept
// row whose slot is not listed is freed (every kept row, without `keep`); then each listed slot
// not held, in list order, takes the lowest free row and is listed to move: head g's
// move_counts[g] slots at move_slots + g * list.capacity, going to the rows at move_rows + g *
// list.capacity (a BlockRowsGather's slots, dst_rows and list_counts). A listed slot outside
// [0, map_capacity), or one that finds no free row, is not held and adds one to *errors (null:
// not counted). So after it every listed slot s of head g that fit is at row_of[g *
// map_capacity + s]. Deterministic: every backend plans the same rows.
struct KeptRowsPlan {
  KeptRows kept;
  DeviceSlotList list;
  bool keep = true;
  int32_t* move_slots = nullptr;   // [num_kv_heads, list.capacity]
  int32_t* move_rows = nullptr;    // [num_kv_heads, list.capacity]
  int32_t* move_counts = nullptr;  // [num_kv_heads]
  int32_t* listed = nullptr;       // [num_kv_heads] (null: not written): each head's count taken
  int32_t* workspace = nullptr;    // [num_kv_heads, kept.rows] int32 of scratch
  int32_t* errors = nullptr;
  // Queued on the backend's side queue (Backend::ForkSideQueue), as the gather of its moves
  // that follows it is: the plan then runs beside the layers, not between them. Its kept rows,
  // moves and counts are then the side queue's until a join.
  bool on_side_queue = false;
};

// A decode token's exact choice at a layer (`list`, with the token's own slot in it) as the rows
// its attention reads, rows of head g counted from head g's first row (head_rows rows apart,
// as KvView::head_stride / row_stride): out[g * list.capacity + j] for head g's j-th slot s is
// row_of's row for s where it is held; current_row + g - g * head_rows for s = current_slot (the
// token itself, whose row the step writes: one row per head after every head's); otherwise
// (a miss) the m-th such slot of head g goes to miss_row + g * miss_capacity + m - g *
// head_rows, and is listed to move there: miss_slots + g * list.capacity, miss_counts[g] of
// them (a BlockRowsGather into miss_row's rows with list_counts). A miss past miss_capacity
// adds one to *errors (null: not counted) and reads the current row instead: the caller fails
// what read it.
struct KeptRowsMap {
  KeptRows kept;  // read only
  DeviceSlotList list;
  int64_t head_rows = 0;
  int64_t current_slot = -1, current_row = 0;
  int64_t miss_row = 0, miss_capacity = 0;
  int32_t* out = nullptr;          // [num_kv_heads, list.capacity]
  int32_t* miss_slots = nullptr;   // [num_kv_heads, list.capacity]
  int32_t* miss_counts = nullptr;  // [num_kv_heads]
  int32_t* errors = nullptr;
};

// One decode token's attention in a batch (Backend::AttentionDecodeBatch): AttentionDecode's
// arguments.
struct DecodeAttentionItem {
  MatView q;  // [1, num_heads * head_dim]
  KvView k, v;
  const int32_t* indices = nullptr;  // device [num_kv_heads, num_rows]; null: rows 0 ..
  int64_t num_rows = 0;
  MatView out;
  // The rows attended, in backend memory (a choice made there): the first min(*count,
  // num_rows) of each head's list (num_rows then bounds them and strides the lists); null:
  // num_rows.
  const int32_t* count = nullptr;
};

// INVALID_ARGUMENT, saying what to fix, for a BlockRowsGather whose sizes do not fit (what
// every backend's GatherBlockRows checks before it queues anything).
absl::Status CheckBlockRowsGather(const BlockRowsGather& g);
// The same for KeptRowsPlan and KeptRowsMap.
absl::Status CheckKeptRowsPlan(const KeptRowsPlan& p);
absl::Status CheckKeptRowsMap(const KeptRowsMap& m);

class Backend {
 public:
  // Adding, removing or reordering a virtual function changes the CUDA plugin's ABI: bump
  // kCudaPluginAbi (cuda_plugin.h).
  virtual ~Backend() = default;

  // Counts since the backend was made (any thread's calls).
  BackendCounters counters() const {
    return {allocations_.load(std::memory_order_relaxed),
            copies_to_device_.load(std::memory_order_relaxed),
            copies_to_host_.load(std::memory_order_relaxed),
            synchronizations_.load(std::memory_order_relaxed)};
  }

  virtual std::string Name() const = 0;
  // The dtype of activations (and of MatViews the model allocates for them).
  virtual DType activation_dtype() const = 0;
  // The dtype K/V rows are stored in (KV caches, the KV store): the activations' unless the
  // backend stores them narrower (the CPU's bf16 K/V); Copy converts activations into it.
  virtual DType kv_dtype() const { return activation_dtype(); }
  // Bytes of device memory still free for caches and workspaces.
  virtual size_t FreeMemory() const = 0;
  // Device memory the backend may take for scratch of its own while it runs a step (the CUDA
  // GEMM prefill's attention scores), beyond what callers allocate: admission sets it aside.
  virtual size_t ScratchBytes() const { return 0; }
  // The same for decode attention, which grows with the sequences it attends at once: what
  // `batch` sequences of this shape may take (the CUDA kernel's per-sequence split partials,
  // held twice while a grown workspace replaces the old one).
  virtual size_t DecodeScratchBytes(const AttentionShape& /*shape*/, int /*batch*/) const {
    return 0;
  }
  // Whether buffers from Allocate() are ordinary host memory that other host code (a KV store
  // transport) may write directly.
  virtual bool host_accessible() const { return false; }
  // Threads: a backend's work may run on any one thread at a time (a batching engine's, not the
  // one that built it). The CPU's kernels run on one team for the process (kernels/cpu/team.h).

  virtual absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) = 0;
  // Enqueues the copy; `host` may be reused when it returns.
  virtual absl::Status CopyToDevice(const void* host, void* device, size_t bytes) = 0;
  // Returns when the bytes are on the host (it waits for the work before it: a synchronization).
  virtual absl::Status CopyToHost(const void* device, void* host, size_t bytes) = 0;
  virtual absl::Status Synchronize() = 0;
  // Enqueues a copy to the host that is done at the next CopyToHost or Synchronize (which wait
  // for it as for everything queued before them): `host` holds the bytes, as the device memory
  // held them when this was called in stream order, only after that wait. Several of these and
  // one wait replace as many waits. By default a CopyToHost (a wait now).
  virtual absl::Status CopyToHostLater(const void* device, void* host, size_t bytes) {
    const absl::Status st = CopyToHost(device, host, bytes);
    HostCopiesDone();
    return st;
  }
  // Increases whenever every CopyToHostLater so far is done (at those waits): code that did not
  // make the wait itself compares it with its value after its copy to know whether to wait.
  uint64_t host_copies_done() const { return host_copies_done_.load(std::memory_order_relaxed); }

  // Host memory the device should read where it lies (the KV store's arena, mapped here):
  // pinned and mapped into the device's address space, for GatherRows. Registering the same
  // range again is a no-op. UNIMPLEMENTED where the backend cannot (host-accessible backends
  // read host memory anyway and need no gather).
  virtual absl::Status RegisterHostMemory(const void* data, size_t bytes) {
    return absl::UnimplementedError(Name() + " does not read registered host memory");
  }
  // Forgets the registration that starts at `data` (the memory was, or is about to be, unmapped:
  // a restarted store's arena replaced the old one), after the device work queued so far that
  // may read it; its pages are no longer pinned. A no-op for memory never registered.
  virtual absl::Status UnregisterHostMemory(const void* data) { return absl::OkStatus(); }
  // Packs n rows of row_bytes each into backend memory at dst, row i read from rows[i] (host
  // addresses inside registered memory). INVALID_ARGUMENT for an address outside it.
  virtual absl::Status GatherRows(const void* const* rows, int64_t n, size_t row_bytes, void* dst) {
    return absl::UnimplementedError(Name() + " does not gather rows by address");
  }
  // BlockRowsGather's rows, queued on the backend's stream (no wait), or on its side queue.
  // INVALID_ARGUMENT for a shape that does not fit (checked on the host: sizes, capacities, an
  // arena not registered); what the device memory holds is checked row by row, as
  // BlockRowsGather says.
  virtual absl::Status GatherBlockRows(const BlockRowsGather& g) {
    return absl::UnimplementedError(Name() + " does not gather rows by block table");
  }
  // KeptRowsPlan and KeptRowsMap, queued on the backend's stream (no wait). INVALID_ARGUMENT
  // for shapes that do not fit (checked on the host); what device memory holds is checked entry
  // by entry, as they say.
  virtual absl::Status PlanKeptRows(const KeptRowsPlan& plan);
  virtual absl::Status MapKeptRows(const KeptRowsMap& map);
  // A second queue beside the backend's own (a GPU's copy stream), for gathers over the host
  // link that may run while the layers compute (INFINIGEN.md, decode step 6). Work queued on it
  // after ForkSideQueue starts after everything queued on the backend's own queue before the
  // fork; work queued on the backend's own queue after JoinSideQueue starts after everything
  // queued on the side queue before the join. Neither waits on the host. Synchronize and
  // CopyToHost wait for the backend's own queue, so for side work joined before them; freeing
  // a Buffer waits for both queues. Side work's memory must not be written, nor read for its
  // output, by other work until a join orders them. A backend without a side queue (the CPU)
  // runs such work at once, in order: both are no-ops.
  virtual absl::Status ForkSideQueue() { return absl::OkStatus(); }
  virtual absl::Status JoinSideQueue() { return absl::OkStatus(); }

  // Uploads a float32 host matrix [rows, cols] in the backend's weight format.
  virtual absl::StatusOr<Weight> UploadWeight(const float* host, int64_t rows, int64_t cols) = 0;
  // The same for a matrix read from a checkpoint: a backend that keeps some stored formats as
  // they are picks by them. The default decodes the whole matrix and calls UploadWeight.
  virtual absl::StatusOr<Weight> UploadStoredWeight(const StoredWeight& stored);
  // A weight [rows, cols] of cpu::FillRandom(seed, scale) values in the backend's format (for
  // benchmarks of shapes no checkpoint is at hand for). The default makes them on the host and
  // uploads them; a device fills its own memory.
  virtual absl::StatusOr<Weight> UploadRandomWeight(int64_t rows, int64_t cols, uint64_t seed,
                                                    float scale);

  // out[i, :] = table[ids[i], :]; ids in device memory, already checked against the vocab.
  virtual absl::Status Embedding(const Weight& table, const int32_t* ids, MatView out) = 0;
  virtual absl::Status RmsNorm(MatView x, const Weight& weight, float eps, MatView out) = 0;
  // bias may be null.
  virtual absl::Status LayerNorm(MatView x, const Weight& weight, const Weight* bias, float eps,
                                 MatView out) = 0;
  // out = x · wᵀ + bias (+ out when accumulate). bias may be null.
  virtual absl::Status Linear(MatView x, const Weight& w, const Weight* bias, MatView out,
                              bool accumulate) = 0;
  // Rotates heads of x in place; positions [x.rows] and inv_freq [rotary_dim / 2, or one such
  // table per head inv_freq_head_stride apart] are device arrays.
  virtual absl::Status Rope(MatView x, int num_heads, int head_dim, int rotary_dim,
                            const int32_t* positions, const float* inv_freq, cpu::RopeLayout layout,
                            int64_t inv_freq_head_stride = 0) = 0;
  // Each head of x [rows, num_heads * head_dim] times its KV head's skew (device f32,
  // [num_kv_heads, head_dim, partial_dim]) into out [rows, num_heads * partial_dim]
  // (kernels/cpu/ops.h ProjectHeads).
  virtual absl::Status ProjectHeads(MatView x, int num_heads, int num_kv_heads, int head_dim,
                                    const float* skew, int partial_dim, MatView out) = 0;
  virtual absl::Status SwiGlu(MatView gate, MatView up, MatView out) = 0;
  virtual absl::Status Relu(MatView x) = 0;
  // y += x.
  virtual absl::Status Add(MatView x, MatView y) = 0;
  // dst = src (same shape, any strides).
  virtual absl::Status Copy(MatView src, MatView dst) = 0;

  // Causal attention of q's rows (positions q_start ..) over K/V rows 0 .. q_start + q.rows - 1.
  virtual absl::Status AttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                                       const AttentionShape& shape, MatView out) = 0;
  // One query row over num_rows rows per KV head, listed by indices [num_kv_heads, num_rows]
  // in device memory (null: rows 0 .. num_rows - 1). `weights_out` (device, [num_heads,
  // num_rows], may be null) receives the attention probabilities.
  virtual absl::Status AttentionDecode(MatView q, KvView k, KvView v, const int32_t* indices,
                                       int64_t num_rows, const AttentionShape& shape, MatView out,
                                       float* weights_out = nullptr) = 0;

  // AttentionDecode of each item (no attention weights), a batch's decode tokens at once: one
  // launch on a GPU, each item's result exactly what AttentionDecode of it alone gives (its
  // split of the rows depends on its own rows only: a sequence's output does not depend on its
  // batch). By default one AttentionDecode per item.
  virtual absl::Status AttentionDecodeBatch(std::span<const DecodeAttentionItem> items,
                                            const AttentionShape& shape);

  // InfiniGen on the backend (PartialKeysShape, RowChoiceRequest). Projects rows of `k` ([rows,
  // num_kv_heads * head_dim] after RoPE) through `skew` (float32 [num_kv_heads, head_dim,
  // partial_dim] in backend memory) into rows first_row .. of the partial key cache `keys`.
  virtual absl::Status AppendPartialKeys(MatView k, const float* skew,
                                         const PartialKeysShape& shape, void* keys,
                                         int64_t first_row);
  // Backend memory ChooseRows needs for a request over `rows` rows.
  virtual size_t ChooseRowsWorkspaceBytes(int num_heads, int num_kv_heads, int64_t rows) const {
    return 0;
  }
  // Whether ChooseRows takes `num_heads` query heads over `num_kv_heads` with `partial_dim`
  // partial channels a head (INVALID_ARGUMENT saying what to change if not). A policy that
  // chooses on the backend asks when it is made, so that a worker refuses the sidecar at start
  // instead of failing its first decode step.
  virtual absl::Status CheckRowChoiceShape(int num_heads, int num_kv_heads, int partial_dim) const {
    return absl::OkStatus();
  }
  // Launches the choice; nothing waits for it (the indices and count are read where they lie).
  virtual absl::Status ChooseRows(const RowChoiceRequest& request, void* workspace);

 protected:
  void CountAllocation() { allocations_.fetch_add(1, std::memory_order_relaxed); }
  void CountCopyToDevice() { copies_to_device_.fetch_add(1, std::memory_order_relaxed); }
  void CountCopyToHost() { copies_to_host_.fetch_add(1, std::memory_order_relaxed); }
  void CountSynchronization() { synchronizations_.fetch_add(1, std::memory_order_relaxed); }
  void HostCopiesDone() { host_copies_done_.fetch_add(1, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> allocations_{0}, copies_to_device_{0}, copies_to_host_{0},
      synchronizations_{0};
  std::atomic<uint64_t> host_copies_done_{0};
};

}  // namespace infinigen
