#include "gpu_worker/backend/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/backend/cuda_internal.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace infinigen {

using cuda_backend_internal::BlasType;
using cuda_backend_internal::Check;
using cuda_backend_internal::CheckBlas;
using cuda_backend_internal::M;
using cuda_backend_internal::S;
using cuda_backend_internal::ToElem;

namespace {

DType WeightDType(WeightFormat f) {
  return f == WeightFormat::kF16    ? DType::kF16
         : f == WeightFormat::kBF16 ? DType::kBF16
                                    : DType::kF32;
}

WeightFormat FormatOf(DType t) {
  return t == DType::kF16    ? WeightFormat::kF16
         : t == DType::kBF16 ? WeightFormat::kBF16
                             : WeightFormat::kF32;
}

class DeviceBuffer final : public Buffer {
 public:
  DeviceBuffer(void* data, size_t size) : data_(data), size_(size) {}
  ~DeviceBuffer() override { cudaFree(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  void* data_;
  size_t size_;
};

const float* F(const Weight* w) {
  return w != nullptr && *w ? static_cast<const float*>(w->data()) : nullptr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    const CudaBackendOptions& options) {
  CudaBackendOptions o = options;
  const char* causal = std::getenv("INFINIGEN_CUDA_CAUSAL");
  if (causal != nullptr && *causal != '\0') {
    const std::string_view c(causal);
    if (c != "gemm" && c != "tiles") {
      return absl::InvalidArgumentError(absl::StrCat("cuda backend: INFINIGEN_CUDA_CAUSAL is \"",
                                                     std::string(c),
                                                     "\"; use gemm or tiles (or unset it)"));
    }
    o.gemm_causal_attention = c == "gemm";
  }
  const int count = cuda::DeviceCount();
  if (options.device < 0 || options.device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda backend: no CUDA device ", options.device, " (", count, " usable devices)"));
  }
  IG_RETURN_IF_ERROR(Check(cudaSetDevice(options.device), "cudaSetDevice"));
  cudaStream_t stream = nullptr;
  IG_RETURN_IF_ERROR(
      Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  auto handles = std::make_unique<Handles>();
  if (auto st = CheckBlas(cublasCreate(&handles->blas), "create"); !st.ok()) {
    cudaStreamDestroy(stream);
    return st;
  }
  IG_RETURN_IF_ERROR(CheckBlas(cublasSetStream(handles->blas, stream), "set stream"));
  // Pedantic math in f32 mode (no TF32), tensor cores for 16-bit types.
  IG_RETURN_IF_ERROR(CheckBlas(
      cublasSetMathMode(handles->blas,
                        options.dtype == DType::kF32 ? CUBLAS_PEDANTIC_MATH : CUBLAS_DEFAULT_MATH),
      "set math mode"));
  return std::unique_ptr<CudaBackend>(new CudaBackend(o, std::move(handles), stream));
}

CudaBackend::CudaBackend(const CudaBackendOptions& options, std::unique_ptr<Handles> handles,
                         void* stream)
    : options_(options), handles_(std::move(handles)), stream_(stream) {}

CudaBackend::~CudaBackend() {
  cudaStreamSynchronize(S(stream_));
  if (side_stream_ != nullptr) {
    cudaStreamSynchronize(S(side_stream_));
    cudaEventDestroy(static_cast<cudaEvent_t>(fork_event_));
    cudaEventDestroy(static_cast<cudaEvent_t>(join_event_));
    cudaStreamDestroy(S(side_stream_));
  }
  for (PinnedHalf& h : pinned_) {
    if (h.host != nullptr) cudaFreeHost(h.host);
    if (h.copied != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(h.copied));
  }
  if (readback_ != nullptr) cudaFreeHost(readback_);
  for (const HostRegion& r : host_regions_) cudaHostUnregister(const_cast<char*>(r.host));
  cudaGetLastError();  // a region unmapped before us fails to unregister: nothing to do
  row_table_device_.reset();
  retired_.clear();
  workspace_.reset();
  handles_.reset();
  cudaStreamDestroy(S(stream_));
}

std::string CudaBackend::Name() const {
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, options_.device);
  return absl::StrCat("cuda-", DTypeName(options_.dtype), " (", prop.name, ")");
}

size_t CudaBackend::FreeMemory() const {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return free;
}

absl::StatusOr<std::unique_ptr<Buffer>> CudaBackend::Allocate(size_t bytes) {
  CountAllocation();
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda backend: cannot allocate ", bytes,
                     " bytes of GPU memory: ", cudaGetErrorString(err)));
  }
  return std::make_unique<DeviceBuffer>(p, bytes);
}

namespace {
constexpr size_t kPinnedHalfBytes = size_t{32} << 20;
}  // namespace

char* CudaBackend::StageForDevice(size_t bytes) {
  bytes = (bytes + 255) & ~size_t{255};
  if (bytes > kPinnedHalfBytes || pinned_failed_) return nullptr;
  if (pinned_[0].host == nullptr) {
    for (PinnedHalf& h : pinned_) {
      cudaEvent_t e = nullptr;
      if (cudaHostAlloc(reinterpret_cast<void**>(&h.host), kPinnedHalfBytes,
                        cudaHostAllocDefault) != cudaSuccess ||
          cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        pinned_failed_ = true;  // pageable copies, as before
        return nullptr;
      }
      h.copied = e;
    }
  }
  PinnedHalf* h = &pinned_[pinned_at_];
  if (h->used + bytes > kPinnedHalfBytes) {  // this half is full: the other one, once free
    cudaEventRecord(static_cast<cudaEvent_t>(h->copied), S(stream_));
    h->pending = true;
    pinned_at_ ^= 1;
    h = &pinned_[pinned_at_];
    if (h->pending && cudaEventQuery(static_cast<cudaEvent_t>(h->copied)) != cudaSuccess) {
      cudaGetLastError();
      CountSynchronization();
      cudaEventSynchronize(static_cast<cudaEvent_t>(h->copied));
    }
    h->pending = false;
    h->used = 0;
  }
  char* at = h->host + h->used;
  h->used += bytes;
  return at;
}

absl::Status CudaBackend::CopyToDevice(const void* host, void* device, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  CountCopyToDevice();
  // Through pinned staging where it fits (see PinnedHalf), so that the copy is queued and the
  // host goes on; from pageable memory otherwise (the runtime stages the source before
  // returning, so `host` may be reused at once either way).
  const void* from = host;
  if (char* staged = StageForDevice(bytes); staged != nullptr) {
    std::memcpy(staged, host, bytes);
    from = staged;
  }
  return Check(cudaMemcpyAsync(device, from, bytes, cudaMemcpyHostToDevice, S(stream_)),
               "copy to device");
}

absl::Status CudaBackend::CopyToHost(const void* device, void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  CountCopyToHost();
  CountSynchronization();
  IG_RETURN_IF_ERROR(Check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, S(stream_)),
                           "copy to host"));
  const absl::Status waited = Check(cudaStreamSynchronize(S(stream_)), "copy to host");
  FinishLaterCopies();  // (after a failed wait the bytes are the device's error to report)
  return waited;
}

absl::Status CudaBackend::CopyToHostLater(const void* device, void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  const size_t rounded = (bytes + 255) & ~size_t{255};
  readback_asked_ += rounded;
  // Grown to what was wanted at an interval's first copy only (not after a wait forced below,
  // which would free the pinned memory, a device-wide wait, in the middle of a step).
  const bool first = readback_asked_ == rounded;
  if (readback_used_ + rounded > readback_capacity_ ||
      (first && later_.empty() && readback_wanted_ > readback_capacity_)) {
    if (!later_.empty()) {  // full until the next wait: then grown to what was wanted
      // This wait is the room's, not the caller's: the bytes asked for until the caller's
      // next wait go on adding up (the copies after it ask for more), so that the room grows
      // once to what they all need rather than doubling over the next steps' waits.
      const size_t asked = readback_asked_;
      const absl::Status st = CopyToHost(device, host, bytes);
      readback_asked_ = asked;
      return st;
    }
    // Grown while no copy uses it; 8 MiB at first (a layer's choices and new K/V rows), or
    // what the copies between two waits wanted (a decode step's held appends of every layer).
    const size_t capacity =
        std::max({rounded, readback_capacity_ * 2, size_t{8} << 20, readback_wanted_});
    if (readback_ != nullptr) cudaFreeHost(readback_);
    readback_ = nullptr;
    readback_capacity_ = readback_used_ = 0;
    if (cudaHostAlloc(reinterpret_cast<void**>(&readback_), capacity, cudaHostAllocDefault) !=
        cudaSuccess) {
      cudaGetLastError();
      readback_ = nullptr;
      const size_t asked = readback_asked_;
      const absl::Status st = CopyToHost(device, host, bytes);  // no pinned memory: a wait now
      readback_asked_ = asked;
      return st;
    }
    readback_capacity_ = capacity;
  }
  CountCopyToHost();
  char* pinned = readback_ + readback_used_;
  IG_RETURN_IF_ERROR(Check(
      cudaMemcpyAsync(pinned, device, bytes, cudaMemcpyDeviceToHost, S(stream_)), "copy to host"));
  readback_used_ += rounded;
  later_.push_back({pinned, host, bytes});
  return absl::OkStatus();
}

void CudaBackend::FinishLaterCopies() {
  readback_wanted_ = std::max(readback_wanted_, readback_asked_);
  readback_asked_ = 0;
  for (const LaterCopy& c : later_) std::memcpy(c.host, c.pinned, c.bytes);
  later_.clear();
  readback_used_ = 0;
  retired_.clear();  // after a wait: nothing queued can read them now
  HostCopiesDone();
}

absl::Status CudaBackend::Synchronize() {
  CountSynchronization();
  const absl::Status waited = Check(cudaStreamSynchronize(S(stream_)), "synchronize");
  FinishLaterCopies();
  return waited;
}

// Buffers are freed with cudaFree, which waits for the whole device (both streams): what
// Backend says of a freed Buffer and the side queue.
absl::Status CudaBackend::ForkSideQueue() {
  if (side_stream_ == nullptr) {
    cudaStream_t side = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    IG_RETURN_IF_ERROR(
        Check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "side queue stream"));
    if (absl::Status st =
            Check(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "side queue event");
        !st.ok()) {
      cudaStreamDestroy(side);
      return st;
    }
    if (absl::Status st =
            Check(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "side queue event");
        !st.ok()) {
      cudaEventDestroy(fork);
      cudaStreamDestroy(side);
      return st;
    }
    side_stream_ = side;
    fork_event_ = fork;
    join_event_ = join;
  }
  IG_RETURN_IF_ERROR(
      Check(cudaEventRecord(static_cast<cudaEvent_t>(fork_event_), S(stream_)), "fork"));
  return Check(cudaStreamWaitEvent(S(side_stream_), static_cast<cudaEvent_t>(fork_event_), 0),
               "fork");
}

absl::Status CudaBackend::JoinSideQueue() {
  if (side_stream_ == nullptr) return absl::OkStatus();
  IG_RETURN_IF_ERROR(
      Check(cudaEventRecord(static_cast<cudaEvent_t>(join_event_), S(side_stream_)), "join"));
  return Check(cudaStreamWaitEvent(S(stream_), static_cast<cudaEvent_t>(join_event_), 0), "join");
}

absl::Status CudaBackend::RegisterHostMemory(const void* data, size_t bytes) {
  const char* host = static_cast<const char*>(data);
  for (const HostRegion& r : host_regions_) {
    if (r.host == host && r.bytes == bytes) return absl::OkStatus();
  }
  int read_only = 0;
  cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, options_.device);
  const unsigned flags = cudaHostRegisterMapped | (read_only ? cudaHostRegisterReadOnly : 0u);
  cudaError_t err = cudaHostRegister(const_cast<char*>(host), bytes, flags);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda backend: cannot register ", bytes, " bytes of host memory for the GPU to read",
        read_only ? "" : " (this device cannot register read-only memory)", ": ",
        cudaGetErrorString(err)));
  }
  void* device = nullptr;
  err = cudaHostGetDevicePointer(&device, const_cast<char*>(host), 0);
  if (err != cudaSuccess) {
    cudaHostUnregister(const_cast<char*>(host));
    return Check(err, "cudaHostGetDevicePointer");
  }
  host_regions_.push_back({host, static_cast<char*>(device), bytes});
  return absl::OkStatus();
}

absl::Status CudaBackend::UnregisterHostMemory(const void* data) {
  auto it = std::find_if(host_regions_.begin(), host_regions_.end(),
                         [data](const HostRegion& r) { return r.host == data; });
  if (it == host_regions_.end()) return absl::OkStatus();
  // Gathers queued on either stream may still read it.
  absl::Status st = Check(cudaStreamSynchronize(S(stream_)), "cudaStreamSynchronize");
  if (st.ok() && side_stream_ != nullptr) {
    st = Check(cudaStreamSynchronize(S(side_stream_)), "cudaStreamSynchronize");
  }
  if (!st.ok()) return st;
  // The range may be unmapped already (the store client maps the new arena, then unmaps the old):
  // the driver still holds its pinned pages and lets them go here.
  const cudaError_t err = cudaHostUnregister(const_cast<char*>(it->host));
  host_regions_.erase(it);
  if (err != cudaSuccess) cudaGetLastError();
  return err == cudaSuccess || err == cudaErrorHostMemoryNotRegistered
             ? absl::OkStatus()
             : Check(err, "cudaHostUnregister");
}

const CudaBackend::HostRegion* CudaBackend::RegionOf(const char* p, size_t bytes) const {
  for (const HostRegion& r : host_regions_) {
    if (p >= r.host && p + bytes <= r.host + r.bytes) return &r;
  }
  return nullptr;
}

absl::Status CudaBackend::GatherRows(const void* const* rows, int64_t n, size_t row_bytes,
                                     void* dst) {
  if (n <= 0) return absl::OkStatus();
  row_table_.resize(static_cast<size_t>(n));
  const HostRegion* region = host_regions_.empty() ? nullptr : &host_regions_.back();
  int64_t align = 0;
  for (int64_t i = 0; i < n; ++i) {
    const char* p = static_cast<const char*>(rows[i]);
    if (region == nullptr || p < region->host || p + row_bytes > region->host + region->bytes) {
      region = RegionOf(p, row_bytes);
      if (region == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("cuda backend: row ", i,
                         " of a gather is not in host memory registered with "
                         "RegisterHostMemory"));
      }
    }
    const char* device = region->device + (p - region->host);
    row_table_[static_cast<size_t>(i)] = device;
    align |= reinterpret_cast<int64_t>(device);
  }
  const size_t table_bytes = static_cast<size_t>(n) * sizeof(void*);
  if (row_table_device_ == nullptr || row_table_device_->size() < table_bytes) {
    // By half again at least: a sequence's tables grow a row per step, and an allocation (and
    // the free's wait) per step is what a decode step must not do.
    const size_t grown = row_table_device_ ? row_table_device_->size() * 3 / 2 : 0;
    row_table_device_.reset();
    IG_ASSIGN_OR_RETURN(row_table_device_, Allocate(std::max({table_bytes, grown, size_t{4096}})));
  }
  IG_RETURN_IF_ERROR(CopyToDevice(row_table_.data(), row_table_device_->data(), table_bytes));
  return Check(cuda::GatherRowTable(static_cast<const void* const*>(row_table_device_->data()), n,
                                    static_cast<int64_t>(row_bytes), align, dst, S(stream_)),
               "GatherRows");
}

absl::Status CudaBackend::GatherBlockRows(const BlockRowsGather& g) {
  IG_RETURN_IF_ERROR(CheckBlockRowsGather(g));
  if (g.batch == 0 || g.max_count == 0) return absl::OkStatus();
  const char* arena = static_cast<const char*>(g.arena);
  const HostRegion* region = RegionOf(arena, g.arena_bytes);
  if (region == nullptr) {
    return absl::InvalidArgumentError(
        "cuda backend: the arena of a block-table gather is not in host memory registered with "
        "RegisterHostMemory");
  }
  cuda::Gather k;
  k.batch = g.batch;
  k.num_kv_heads = g.num_kv_heads;
  k.row_bytes = g.row_bytes;
  k.src = region->device + (arena - region->host);
  k.src_bytes = static_cast<int64_t>(g.arena_bytes);
  k.indices = g.slots;
  k.index_capacity = g.slot_capacity;
  k.counts = g.counts;
  k.list_counts = g.list_counts;
  k.count = g.max_count;
  k.max_count = g.max_count;
  k.dst = g.dst;
  k.dst_rows_per_head = g.dst_rows_per_list;
  k.dst_rows = g.dst_rows;
  k.tables = g.tables;
  k.table_capacity = g.table_capacity;
  k.table_rows = g.rows_per_block;
  k.block_bytes = static_cast<int64_t>(g.block_bytes);
  k.errors = g.errors;
  // On the side queue once it exists (ForkSideQueue made it); on the backend's stream before.
  void* stream = g.on_side_queue && side_stream_ != nullptr ? side_stream_ : stream_;
  return Check(cuda::RunGather(k, S(stream)), "GatherBlockRows");
}

namespace {

cuda::KeptRowsArgs KeptRowsArgsOf(const KeptRows& k, const DeviceSlotList& list, int32_t* errors) {
  cuda::KeptRowsArgs a;
  a.num_kv_heads = k.num_kv_heads;
  a.row_of = k.row_of;
  a.map_capacity = k.map_capacity;
  a.slot_of = k.slot_of;
  a.rows = k.rows;
  a.slots = list.slots;
  a.count = list.count;
  a.capacity = list.capacity;
  a.max_count = list.max_count;
  a.errors = errors;
  return a;
}

}  // namespace

absl::Status CudaBackend::PlanKeptRows(const KeptRowsPlan& p) {
  IG_RETURN_IF_ERROR(CheckKeptRowsPlan(p));
  void* stream = p.on_side_queue && side_stream_ != nullptr ? side_stream_ : stream_;
  return Check(cuda::PlanKeptRows(KeptRowsArgsOf(p.kept, p.list, p.errors), p.keep, p.move_slots,
                                  p.move_rows, p.move_counts, p.listed, p.workspace, S(stream)),
               "PlanKeptRows");
}

absl::Status CudaBackend::MapKeptRows(const KeptRowsMap& m) {
  IG_RETURN_IF_ERROR(CheckKeptRowsMap(m));
  return Check(cuda::MapKeptRows(KeptRowsArgsOf(m.kept, m.list, m.errors), m.head_rows,
                                 m.current_slot, m.current_row, m.miss_row, m.miss_capacity, m.out,
                                 m.miss_slots, m.miss_counts, S(stream_)),
               "MapKeptRows");
}

absl::StatusOr<Weight> CudaBackend::UploadWeight(const float* host, int64_t rows, int64_t cols) {
  Weight w;
  w.rows = rows;
  w.cols = cols;
  w.format = rows == 1 ? WeightFormat::kF32 : FormatOf(options_.dtype);
  const DType t = WeightDType(w.format);
  const size_t n = static_cast<size_t>(rows * cols);
  IG_ASSIGN_OR_RETURN(w.buffer, Allocate(n * DTypeSize(t)));
  if (t == DType::kF32) {
    IG_RETURN_IF_ERROR(CopyToDevice(host, w.buffer->data(), n * 4));
  } else {
    std::vector<uint16_t> packed(n);
    ConvertFromFloat(host, t, packed.data(), n);
    // CopyToDevice stages pageable memory before it returns: `packed` may go.
    IG_RETURN_IF_ERROR(CopyToDevice(packed.data(), w.buffer->data(), n * 2));
  }
  return w;
}

absl::StatusOr<Weight> CudaBackend::UploadRandomWeight(int64_t rows, int64_t cols, uint64_t seed,
                                                       float scale) {
  Weight w;
  w.rows = rows;
  w.cols = cols;
  w.format = rows == 1 ? WeightFormat::kF32 : FormatOf(options_.dtype);
  const DType t = WeightDType(w.format);
  IG_ASSIGN_OR_RETURN(w.buffer, Allocate(static_cast<size_t>(rows * cols) * DTypeSize(t)));
  // The same values as cpu::FillRandom, rounded to the weight type on the device.
  IG_RETURN_IF_ERROR(
      Check(cuda::FillRandom(w.buffer->data(), ToElem(t), rows * cols, seed, scale, S(stream_)),
            "FillRandom"));
  return w;
}

absl::Status CudaBackend::Embedding(const Weight& table, const int32_t* ids, MatView out) {
  if (out.cols != table.cols) return absl::InvalidArgumentError("cuda backend: Embedding width");
  return Check(
      cuda::Embedding(table.data(), ToElem(WeightDType(table.format)), ids, M(out), S(stream_)),
      "Embedding");
}

absl::Status CudaBackend::RmsNorm(MatView x, const Weight& weight, float eps, MatView out) {
  return Check(cuda::RmsNorm(M(x), F(&weight), eps, M(out), S(stream_)), "RmsNorm");
}

absl::Status CudaBackend::LayerNorm(MatView x, const Weight& weight, const Weight* bias, float eps,
                                    MatView out) {
  return Check(cuda::LayerNorm(M(x), F(&weight), F(bias), eps, M(out), S(stream_)), "LayerNorm");
}

absl::Status CudaBackend::Linear(MatView x, const Weight& w, const Weight* bias, MatView out,
                                 bool accumulate) {
  const DType wt = WeightDType(w.format);
  if (x.cols != w.cols || out.cols != w.rows || out.rows != x.rows || x.dtype != wt ||
      (out.dtype != x.dtype && out.dtype != DType::kF32)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: Linear [", x.rows, ", ", x.cols,
                                                   "] ", DTypeName(x.dtype), " x [", w.rows, ", ",
                                                   w.cols, "]^T ", DTypeName(wt), " -> [", out.rows,
                                                   ", ", out.cols, "] ", DTypeName(out.dtype)));
  }
  if (x.rows == 0) return absl::OkStatus();
  // Row-major y[m, n] = x[m, k] w[n, k]^T is column-major y'[n, m] = w'^T x' where w' ([k, n])
  // and x' ([k, m]) are the same bytes read column-major.
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  IG_RETURN_IF_ERROR(
      CheckBlas(cublasGemmEx(handles_->blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows),
                             static_cast<int>(x.rows), static_cast<int>(w.cols), &alpha, w.data(),
                             BlasType(wt), static_cast<int>(w.cols), x.data, BlasType(x.dtype),
                             static_cast<int>(x.stride), &beta, out.data, BlasType(out.dtype),
                             static_cast<int>(out.stride), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "GemmEx"));
  if (bias != nullptr && *bias) {
    IG_RETURN_IF_ERROR(Check(cuda::AddBias(F(bias), M(out), S(stream_)), "Linear bias"));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Rope(MatView x, int num_heads, int head_dim, int rotary_dim,
                               const int32_t* positions, const float* inv_freq,
                               cpu::RopeLayout layout, int64_t inv_freq_head_stride) {
  return Check(
      cuda::Rope(M(x), num_heads, head_dim, rotary_dim, positions, inv_freq,
                 layout == cpu::RopeLayout::kInterleaved, S(stream_), inv_freq_head_stride),
      "Rope");
}

namespace {
// The heads of x's rows through the skew's partial channels (the output is the caller's).
cuda::PartialProjection Projection(const MatView& x, int num_heads, int num_kv_heads, int head_dim,
                                   const float* skew, int partial_dim) {
  cuda::PartialProjection p;
  p.x_type = ToElem(x.dtype);
  p.x = x.data;
  p.x_seq_stride = x.stride;
  p.batch = static_cast<int>(x.rows);
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.partial_dim = partial_dim;
  p.skew = skew;
  return p;
}
}  // namespace

absl::Status CudaBackend::ProjectHeads(MatView x, int num_heads, int num_kv_heads, int head_dim,
                                       const float* skew, int partial_dim, MatView out) {
  if (out.rows != x.rows || x.cols != static_cast<int64_t>(num_heads) * head_dim ||
      out.cols != static_cast<int64_t>(num_heads) * partial_dim) {
    return absl::InvalidArgumentError("cuda backend: ProjectHeads shapes do not match");
  }
  cuda::PartialProjection p = Projection(x, num_heads, num_kv_heads, head_dim, skew, partial_dim);
  p.out_type = ToElem(out.dtype);
  p.out = out.data;
  p.out_seq_stride = out.stride;
  p.out_head_stride = partial_dim;
  if (x.rows == 0) return absl::OkStatus();
  return Check(cuda::RunPartialProjection(p, S(stream_)), "ProjectHeads");
}

absl::Status CudaBackend::AppendPartialKeys(MatView k, const float* skew,
                                            const PartialKeysShape& shape, void* keys,
                                            int64_t first_row) {
  if (first_row < 0 || first_row + k.rows > shape.capacity ||
      k.cols != static_cast<int64_t>(shape.num_kv_heads) * shape.head_dim) {
    return absl::InvalidArgumentError("cuda backend: AppendPartialKeys shapes do not match");
  }
  // In pieces of at most 65535 rows (a launch's grid rows): a restored sequence's whole length
  // arrives at once.
  constexpr int64_t kMaxRows = 65535;
  for (int64_t r0 = 0; r0 < k.rows; r0 += kMaxRows) {
    const MatView piece = k.Rows(r0, std::min(kMaxRows, k.rows - r0));
    cuda::PartialProjection p = Projection(piece, shape.num_kv_heads, shape.num_kv_heads,
                                           shape.head_dim, skew, shape.partial_dim);
    p.out_type = cuda::Elem::kBF16;  // channel-major per head (PartialKeysShape)
    p.out = static_cast<uint16_t*>(keys) + first_row + r0;
    p.out_seq_stride = 1;
    p.out_head_stride = static_cast<int64_t>(shape.partial_dim) * shape.capacity;
    p.out_channel_stride = shape.capacity;
    IG_RETURN_IF_ERROR(Check(cuda::RunPartialProjection(p, S(stream_)), "AppendPartialKeys"));
  }
  return absl::OkStatus();
}

namespace {
// The f32 copy of the query in the workspace: as many channels as the speculation reads.
constexpr int kMaxChoicePartialDim = cuda::kMaxSpeculationPartialDim;
}  // namespace

size_t CudaBackend::ChooseRowsWorkspaceBytes(int num_heads, int num_kv_heads, int64_t rows) const {
  cuda::Speculation s;
  s.num_heads = num_heads;
  s.num_kv_heads = num_kv_heads;
  s.max_rows = static_cast<int32_t>(rows);
  return cuda::SpeculationWorkspaceBytes(s) +
         static_cast<size_t>(num_heads) * kMaxChoicePartialDim * sizeof(float);
}

absl::Status CudaBackend::CheckRowChoiceShape(int num_heads, int num_kv_heads,
                                              int partial_dim) const {
  if (partial_dim > kMaxChoicePartialDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: ChooseRows reads at most ", kMaxChoicePartialDim,
                     " partial channels a head, got ", partial_dim,
                     " (a sidecar from `infinigen prepare` with a smaller --ratio)"));
  }
  if (num_heads > cuda::kMaxSpeculationGroup * num_kv_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: ChooseRows takes at most ", cuda::kMaxSpeculationGroup,
                     " query heads a KV head, got ", num_heads, " / ", num_kv_heads));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::ChooseRows(const RowChoiceRequest& r, void* workspace) {
  const PartialKeysShape& shape = r.keys_shape;
  IG_RETURN_IF_ERROR(CheckRowChoiceShape(r.num_heads, shape.num_kv_heads, shape.partial_dim));
  if (r.rows <= 0 || r.rows > shape.capacity || r.rows >= (int64_t{1} << 31) ||
      r.q_partial.cols != static_cast<int64_t>(r.num_heads) * shape.partial_dim) {
    return absl::InvalidArgumentError("cuda backend: ChooseRows shapes do not match");
  }
  cuda::Speculation s;
  s.batch = 1;
  s.num_heads = r.num_heads;
  s.num_kv_heads = shape.num_kv_heads;
  s.partial_dim = shape.partial_dim;
  s.scale = r.scale;
  s.key_type = cuda::Elem::kBF16;
  s.keys = r.keys;
  s.key_head_stride = static_cast<int64_t>(shape.partial_dim) * shape.capacity;
  s.key_row_stride = 1;
  s.key_channel_stride = shape.capacity;
  s.max_rows = static_cast<int32_t>(r.rows);
  s.alpha = r.alpha;
  s.k_min = static_cast<int32_t>(r.k_min);
  s.k_max = r.k_max;
  s.margin = r.margin;
  s.force_last = r.force_last;
  s.indices = r.indices;
  s.index_capacity = r.index_capacity;
  s.counts = r.count;
  s.workspace = workspace;
  // The query as float32, after the speculation's own workspace.
  float* q =
      reinterpret_cast<float*>(static_cast<char*>(workspace) + cuda::SpeculationWorkspaceBytes(s));
  const MatView q32{q, DType::kF32, 1, r.q_partial.cols, r.q_partial.cols};
  if (r.q_partial.dtype == DType::kF32) {
    s.q_partial = r.q_partial.As<const float>();
  } else {
    IG_RETURN_IF_ERROR(Copy(r.q_partial.Rows(0, 1), q32));
    s.q_partial = q;
  }
  return Check(cuda::RunSpeculation(s, S(stream_)), "ChooseRows");
}

absl::Status CudaBackend::SwiGlu(MatView gate, MatView up, MatView out) {
  return Check(cuda::SwiGlu(M(gate), M(up), M(out), S(stream_)), "SwiGlu");
}

absl::Status CudaBackend::Relu(MatView x) { return Check(cuda::Relu(M(x), S(stream_)), "Relu"); }

absl::Status CudaBackend::Add(MatView x, MatView y) {
  return Check(cuda::Add(M(x), M(y), S(stream_)), "Add");
}

absl::Status CudaBackend::Copy(MatView src, MatView dst) {
  return Check(cuda::Copy(M(src), M(dst), S(stream_)), "Copy");
}

}  // namespace infinigen
