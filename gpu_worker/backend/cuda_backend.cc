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
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace infinigen {
namespace {

static_assert(static_cast<int>(cuda::Elem::kF32) == static_cast<int>(DType::kF32) &&
                  static_cast<int>(cuda::Elem::kF16) == static_cast<int>(DType::kF16) &&
                  static_cast<int>(cuda::Elem::kBF16) == static_cast<int>(DType::kBF16),
              "cuda::Elem and DType must agree");

cuda::Elem ToElem(DType t) { return static_cast<cuda::Elem>(t); }
cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

// A cudaError_t as a Status: cudaErrorInvalidValue from our own kernels means a shape they do
// not support; anything else is the runtime's failure.
absl::Status Check(cudaError_t err, const char* op) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a non-sticky error so that the next operation is not blamed
  if (err == cudaErrorInvalidValue) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: ", op, " does not support these shapes or types"));
  }
  return absl::InternalError(
      absl::StrCat("cuda backend: ", op, " failed: ", cudaGetErrorString(err)));
}

absl::Status CheckBlas(cublasStatus_t st, const char* op) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("cuda backend: cuBLAS ", op, " failed: ", cublasGetStatusString(st)));
}

cudaDataType_t BlasType(DType t) {
  switch (t) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

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

cuda::Mat M(const MatView& m) { return {m.data, ToElem(m.dtype), m.rows, m.cols, m.stride}; }
const float* F(const Weight* w) {
  return w != nullptr && *w ? static_cast<const float*>(w->data()) : nullptr;
}

}  // namespace

struct CudaBackend::Handles {
  cublasHandle_t blas = nullptr;
  ~Handles() {
    if (blas != nullptr) cublasDestroy(blas);
  }
};

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
  for (PinnedHalf& h : pinned_) {
    if (h.host != nullptr) cudaFreeHost(h.host);
    if (h.copied != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(h.copied));
  }
  if (readback_ != nullptr) cudaFreeHost(readback_);
  for (const HostRegion& r : host_regions_) cudaHostUnregister(const_cast<char*>(r.host));
  cudaGetLastError();  // a region unmapped before us fails to unregister: nothing to do
  row_table_device_.reset();
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

// GemmAttentionCausal's scores of one chunk of query rows: at most this many float32 values and
// as many probabilities in the activations' type (a chunk is at least 16 rows: keys past 4M would
// pass it).
constexpr int64_t kGemmAttentionScores = int64_t{64} << 20;

size_t CudaBackend::ScratchBytes() const {
  if (!options_.gemm_causal_attention || options_.dtype == DType::kF32) return 0;
  return static_cast<size_t>(kGemmAttentionScores) * (sizeof(float) + DTypeSize(options_.dtype));
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
  if (readback_used_ + rounded > readback_capacity_) {
    if (!later_.empty()) return CopyToHost(device, host, bytes);  // full until the next wait
    // Grown while no copy uses it; 8 MiB at first (a layer's choices and new K/V rows).
    const size_t capacity = std::max({rounded, readback_capacity_ * 2, size_t{8} << 20});
    if (readback_ != nullptr) cudaFreeHost(readback_);
    readback_ = nullptr;
    readback_capacity_ = readback_used_ = 0;
    if (cudaHostAlloc(reinterpret_cast<void**>(&readback_), capacity, cudaHostAllocDefault) !=
        cudaSuccess) {
      cudaGetLastError();
      readback_ = nullptr;
      return CopyToHost(device, host, bytes);  // no pinned memory: a wait now
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
  for (const LaterCopy& c : later_) std::memcpy(c.host, c.pinned, c.bytes);
  later_.clear();
  readback_used_ = 0;
  HostCopiesDone();
}

absl::Status CudaBackend::Synchronize() {
  CountSynchronization();
  const absl::Status waited = Check(cudaStreamSynchronize(S(stream_)), "synchronize");
  FinishLaterCopies();
  return waited;
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

absl::Status CudaBackend::GatherRows(const void* const* rows, int64_t n, size_t row_bytes,
                                     void* dst) {
  if (n <= 0) return absl::OkStatus();
  row_table_.resize(static_cast<size_t>(n));
  const HostRegion* region = host_regions_.empty() ? nullptr : &host_regions_.back();
  int64_t align = 0;
  for (int64_t i = 0; i < n; ++i) {
    const char* p = static_cast<const char*>(rows[i]);
    if (region == nullptr || p < region->host || p + row_bytes > region->host + region->bytes) {
      region = nullptr;
      for (const HostRegion& r : host_regions_) {
        if (p >= r.host && p + row_bytes <= r.host + r.bytes) region = &r;
      }
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
constexpr int kMaxChoicePartialDim = 256;  // the f32 copy of the query in the workspace
}  // namespace

size_t CudaBackend::ChooseRowsWorkspaceBytes(int num_heads, int num_kv_heads, int64_t rows) const {
  cuda::Speculation s;
  s.num_heads = num_heads;
  s.num_kv_heads = num_kv_heads;
  s.max_rows = static_cast<int32_t>(rows);
  return cuda::SpeculationWorkspaceBytes(s) +
         static_cast<size_t>(num_heads) * kMaxChoicePartialDim * sizeof(float);
}

absl::Status CudaBackend::ChooseRows(const RowChoiceRequest& r, void* workspace) {
  const PartialKeysShape& shape = r.keys_shape;
  if (r.rows <= 0 || r.rows > shape.capacity || r.rows >= (int64_t{1} << 31) ||
      shape.partial_dim > kMaxChoicePartialDim ||
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

// Query rows from which a 16-bit AttentionCausal goes through GEMMs.
constexpr int64_t kGemmAttentionRows = 128;

absl::Status CudaBackend::AttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                                          const AttentionShape& s, MatView out) {
  if (k.dtype != q.dtype || v.dtype != q.dtype || k.head_stride != v.head_stride ||
      k.row_stride != v.row_stride || k.rows != nullptr || v.rows != nullptr) {
    return absl::InvalidArgumentError(
        "cuda backend: AttentionCausal needs K and V like q, in device memory (no row tables)");
  }
  // Long prompts in 16-bit types through tensor-core GEMMs (the tiled kernel below runs on CUDA
  // cores: 48.9 s of a 32K-token prefill of Llama-3.1-8B on an H200, 5.5 s through the GEMMs,
  // docs/benchmarks.md); short ones and float32 (held to the CPU's arithmetic) through the tiles.
  const bool gemm =
      options_.gemm_causal_attention && q.dtype != DType::kF32 && q.rows >= kGemmAttentionRows;
  if (gemm) return GemmAttentionCausal(q, k, v, q_start, s, out);
  return Check(cuda::AttentionCausal(M(q), q_start, {k.data, k.head_stride, k.row_stride},
                                     {v.data, v.head_stride, v.row_stride}, s.num_heads,
                                     s.num_kv_heads, s.head_dim, s.scale, M(out), S(stream_)),
               "AttentionCausal");
}

absl::Status CudaBackend::GemmAttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                                              const AttentionShape& s, MatView out) {
  if (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0 || q.rows != out.rows ||
      out.dtype != q.dtype) {
    return absl::InvalidArgumentError("cuda backend: AttentionCausal shapes");
  }
  const int64_t n = q.rows, keys = q_start + n, d = s.head_dim;
  const int group = s.num_heads / s.num_kv_heads;
  // Query rows per chunk: at most 1024, and scores of at most 64M floats (256 MiB).
  const int64_t chunk = std::min<int64_t>(
      n, std::max<int64_t>(16, std::min<int64_t>(1024, kGemmAttentionScores / keys)));
  const size_t e = DTypeSize(q.dtype);
  const size_t score_bytes = static_cast<size_t>(chunk * keys) * sizeof(float);
  const size_t prob_bytes = static_cast<size_t>(chunk * keys) * e;
  if (scores_ == nullptr || scores_->size() < score_bytes + prob_bytes) {
    IG_RETURN_IF_ERROR(Synchronize());  // the old buffer may still be in use
    scores_.reset();
    IG_ASSIGN_OR_RETURN(scores_, Allocate(score_bytes + prob_bytes));
  }
  float* scores = static_cast<float*>(scores_->data());
  void* probs = static_cast<uint8_t*>(scores_->data()) + score_bytes;
  const cudaDataType_t t = BlasType(q.dtype);
  const float one = 1.0f, zero = 0.0f;
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t rows = std::min(chunk, n - c0);
    const int64_t cols = q_start + c0 + rows;  // keys the chunk's last row sees
    for (int h = 0; h < s.num_heads; ++h) {
      const int g = h / group;
      const uint8_t* qh = static_cast<const uint8_t*>(q.data) + (c0 * q.stride + h * d) * e;
      const uint8_t* kh = static_cast<const uint8_t*>(k.data) + g * k.head_stride * e;
      const uint8_t* vh = static_cast<const uint8_t*>(v.data) + g * v.head_stride * e;
      uint8_t* oh = static_cast<uint8_t*>(out.data) + (c0 * out.stride + h * d) * e;
      // Row-major scores [rows, cols] are column-major [cols, rows] = K Q^T: K is the
      // column-major [d, cols] matrix at kh (leading dimension its row stride), transposed;
      // Q^T the column-major [d, rows] at qh.
      IG_RETURN_IF_ERROR(
          CheckBlas(cublasGemmEx(handles_->blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(cols),
                                 static_cast<int>(rows), static_cast<int>(d), &one, kh, t,
                                 static_cast<int>(k.row_stride), qh, t, static_cast<int>(q.stride),
                                 &zero, scores, CUDA_R_32F, static_cast<int>(cols),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "GemmEx (attention scores)"));
      IG_RETURN_IF_ERROR(
          Check(cuda::CausalSoftmax(scores, cols, rows, cols, q_start + c0, s.scale,
                                    {probs, ToElem(q.dtype), rows, cols, cols}, S(stream_)),
                "CausalSoftmax"));
      // Row-major out [rows, d] is column-major [d, rows] = V^T P^T: V^T the column-major
      // [d, cols] at vh, P^T the column-major [cols, rows] at probs.
      IG_RETURN_IF_ERROR(CheckBlas(
          cublasGemmEx(handles_->blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(d),
                       static_cast<int>(rows), static_cast<int>(cols), &one, vh, t,
                       static_cast<int>(v.row_stride), probs, t, static_cast<int>(cols), &zero, oh,
                       t, static_cast<int>(out.stride), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "GemmEx (attention output)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::EnsureWorkspace(size_t bytes) {
  if (workspace_ != nullptr && workspace_->size() >= bytes) return absl::OkStatus();
  IG_RETURN_IF_ERROR(Synchronize());  // the old workspace may still be in use
  // By half again at least: the decode attention's partials grow with the rows attended, a row
  // per step (an exact fit reallocated, and waited, every step).
  const size_t grown = workspace_ ? workspace_->size() * 3 / 2 : 0;
  workspace_.reset();
  IG_ASSIGN_OR_RETURN(workspace_, Allocate(std::max(bytes, grown)));
  return absl::OkStatus();
}

absl::Status CudaBackend::AttentionDecode(MatView q, KvView k, KvView v, const int32_t* indices,
                                          int64_t num_rows, const AttentionShape& s, MatView out,
                                          float* weights_out) {
  if (k.dtype != q.dtype || v.dtype != q.dtype || out.dtype != q.dtype ||
      k.head_stride != v.head_stride || k.row_stride != v.row_stride || k.rows != nullptr ||
      v.rows != nullptr) {
    return absl::InvalidArgumentError(
        "cuda backend: AttentionDecode needs K, V and out like q, in device memory (no row "
        "tables)");
  }
  cuda::DecodeAttention a;
  a.type = ToElem(q.dtype);
  a.batch = 1;
  a.num_heads = s.num_heads;
  a.num_kv_heads = s.num_kv_heads;
  a.head_dim = s.head_dim;
  a.scale = s.scale;
  a.q = q.data;
  a.k = k.data;
  a.v = v.data;
  a.head_stride = k.head_stride;
  a.row_stride = k.row_stride;
  a.indices = indices;
  a.index_head_stride = num_rows;
  a.num_rows = static_cast<int32_t>(num_rows);
  a.out = out.data;
  a.weights = weights_out;
  IG_RETURN_IF_ERROR(EnsureWorkspace(cuda::DecodeAttentionWorkspaceBytes(a)));
  a.workspace = workspace_->data();
  return Check(cuda::RunDecodeAttention(a, S(stream_)), "AttentionDecode");
}

}  // namespace infinigen
