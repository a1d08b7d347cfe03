#include "gpu_worker/backend/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "kernels/cpu/packed_gemm.h"
#include "kernels/cpu/q4_1.h"
#include "kernels/cpu/q5_1.h"
#include "kernels/cpu/q6_k.h"
#include "kernels/cpu/row_gemm.h"
#include "kernels/cpu/team.h"

namespace infinigen {
namespace {

constexpr size_t kAlignment = 64;

class HostBuffer final : public Buffer {
 public:
  HostBuffer(void* data, size_t size) : data_(data), size_(size) {}
  ~HostBuffer() override { std::free(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  void* data_;
  size_t size_;
};

const float* F(const Weight& w) { return static_cast<const float*>(w.data()); }
const float* F(const Weight* w) { return w != nullptr && *w ? F(*w) : nullptr; }

// A Q8 weight's buffer holds the int8 values, then (64-byte aligned) the per-block scales.
size_t Q8ScalesOffset(int64_t rows, int64_t cols) { return (rows * cols + 63) / 64 * 64; }

cpu::Q8Matrix Q8View(const Weight& w) {
  const auto* base = static_cast<const uint8_t*>(w.data());
  return {reinterpret_cast<const int8_t*>(base),
          reinterpret_cast<const float*>(base + Q8ScalesOffset(w.rows, w.cols)), w.rows, w.cols};
}

// A Q4_1 weight's buffer holds the packed values (16 bytes a block), then (64-byte aligned) the
// blocks' scales, then their minimums (a Q4_0 weight's, none: each is -8 times the scale).
size_t Q4ScalesOffset(int64_t rows, int64_t cols) { return (rows * cols / 2 + 63) / 64 * 64; }

cpu::Q4_1Matrix Q4View(const Weight& w) {
  const auto* base = static_cast<const uint8_t*>(w.data());
  const auto* d = reinterpret_cast<const float*>(base + Q4ScalesOffset(w.rows, w.cols));
  return {base, d, w.format == WeightFormat::kQ4_0 ? nullptr : d + w.rows * w.cols / cpu::kQ4Block,
          w.rows, w.cols};
}

// A Q5_1 weight's buffer holds the low nibbles (16 bytes a block), then (64-byte aligned) the
// blocks' fifth bits (a 32-bit word each), then their scales, then their minimums (a Q5_0
// weight's, none: each is -16 times the scale).
size_t Q5BitsOffset(int64_t rows, int64_t cols) { return (rows * cols / 2 + 63) / 64 * 64; }
size_t Q5ScalesOffset(int64_t rows, int64_t cols) {
  return Q5BitsOffset(rows, cols) + (rows * cols / cpu::kQ5Block * 4 + 63) / 64 * 64;
}

cpu::Q5_1Matrix Q5View(const Weight& w) {
  const auto* base = static_cast<const uint8_t*>(w.data());
  const auto* d = reinterpret_cast<const float*>(base + Q5ScalesOffset(w.rows, w.cols));
  return {base,   reinterpret_cast<const uint32_t*>(base + Q5BitsOffset(w.rows, w.cols)),
          d,      w.format == WeightFormat::kQ5_0 ? nullptr : d + w.rows * w.cols / cpu::kQ5Block,
          w.rows, w.cols};
}

// A Q6_K weight's buffer holds the low nibbles (half a byte a weight), then (each 64-byte
// aligned) the high bits (a quarter), the scales (one byte per 16 weights), the super-blocks' d.
size_t Aligned64(int64_t bytes) { return static_cast<size_t>((bytes + 63) / 64 * 64); }
size_t Q6HighOffset(int64_t n) { return Aligned64(n / 2); }
size_t Q6ScalesOffset(int64_t n) { return Q6HighOffset(n) + Aligned64(n / 4); }
size_t Q6SuperOffset(int64_t n) { return Q6ScalesOffset(n) + Aligned64(n / 16); }

cpu::Q6_KMatrix Q6View(const Weight& w) {
  const auto* base = static_cast<const uint8_t*>(w.data());
  const int64_t n = w.rows * w.cols;
  return {base,
          base + Q6HighOffset(n),
          reinterpret_cast<const int8_t*>(base + Q6ScalesOffset(n)),
          reinterpret_cast<const float*>(base + Q6SuperOffset(n)),
          w.rows,
          w.cols};
}

}  // namespace

absl::Status CpuBackend::CheckF32(const MatView& m, const char* op) {
  if (m.dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu backend: ", op, " needs f32 activations, got ", DTypeName(m.dtype)));
  }
  return absl::OkStatus();
}

CpuBackend::CpuBackend(const CpuBackendOptions& options) : options_(options) {
  // One team for the process, whichever thread runs the kernels (kernels/cpu/team.h).
  cpu::Team::Get().Configure({options.num_threads, options.pinning});
}

std::string CpuBackend::Name() const {
  const WeightFormat ran = options_.weight_format == WeightFormat::kQ4_1 && !kept_blocks_.load()
                               ? WeightFormat::kQ8
                               : options_.weight_format;
  return absl::StrCat("cpu-", WeightFormatName(ran),
                      options_.kv_dtype == DType::kF32 ? "" : " (bf16 K/V)");
}

size_t CpuBackend::FreeMemory() const {
  const long pages = ::sysconf(_SC_AVPHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? static_cast<size_t>(pages) * page_size : 0;
}

absl::StatusOr<std::unique_ptr<Buffer>> CpuBackend::Allocate(size_t bytes) {
  CountAllocation();
  const size_t rounded = (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend: cannot allocate ", bytes, " bytes of host memory"));
  }
  return std::make_unique<HostBuffer>(p, bytes);
}

absl::Status CpuBackend::CopyToDevice(const void* host, void* device, size_t bytes) {
  CountCopyToDevice();
  std::memcpy(device, host, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyToHostLater(const void* device, void* host, size_t bytes) {
  CountCopyToHost();
  std::memcpy(host, device, bytes);
  HostCopiesDone();
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyToHost(const void* device, void* host, size_t bytes) {
  CountCopyToHost();
  CountSynchronization();  // what a device would wait for here (counted alike on every backend)
  std::memcpy(host, device, bytes);
  return absl::OkStatus();
}

namespace {

// A float32 host matrix as a StoredWeight.
class HostFloats : public StoredWeight {
 public:
  HostFloats(const float* host, int64_t rows, int64_t cols)
      : host_(host), rows_(rows), cols_(cols) {}
  int64_t rows() const override { return rows_; }
  int64_t cols() const override { return cols_; }
  void Decode(int64_t r0, int64_t r1, float* out) const override {
    std::memcpy(out, host_ + r0 * cols_, static_cast<size_t>((r1 - r0) * cols_) * 4);
  }

 private:
  const float* host_;
  int64_t rows_, cols_;
};

// Rows decoded at a time while packing a weight: about 1 MiB of float32.
int64_t RowsPerChunk(int64_t cols) { return std::max<int64_t>(1, (int64_t{1} << 18) / cols); }

// Under q4_1: the block layout that keeps `stored`'s values as they are, or q8.
WeightFormat KeptFormat(const StoredWeight& stored) {
  if (stored.ConvertsToQ4_1()) {
    return stored.ConvertsToQ4_0() ? WeightFormat::kQ4_0 : WeightFormat::kQ4_1;
  }
  if (stored.ConvertsToQ5_1()) {
    return stored.ConvertsToQ5_0() ? WeightFormat::kQ5_0 : WeightFormat::kQ5_1;
  }
  if (stored.ConvertsToQ6_K() && stored.cols() % cpu::kQ6Super == 0) return WeightFormat::kQ6_K;
  return WeightFormat::kQ8;
}

// A stacked matrix with no one kept layout, as runs of consecutive parts that share one (a
// Q4_K_M file's fused QKV: Q and K in Q5_0 or Q4_K, V in Q8_0 or Q6_K); none when no part has a
// kept layout or the parts cannot be viewed.
std::vector<std::unique_ptr<StoredWeight>> KeptRuns(const StoredWeight& stored) {
  const std::vector<int64_t> ends = stored.PartEnds();
  if (ends.size() < 2) return {};
  std::vector<std::pair<int64_t, WeightFormat>> runs;  // (end, format), merged
  int64_t begin = 0;
  bool kept = false;
  for (const int64_t end : ends) {
    const std::unique_ptr<StoredWeight> part = stored.Rows(begin, end);
    if (part == nullptr) return {};
    const WeightFormat f = KeptFormat(*part);
    kept |= f != WeightFormat::kQ8;
    if (!runs.empty() && runs.back().second == f) {
      runs.back().first = end;
    } else {
      runs.emplace_back(end, f);
    }
    begin = end;
  }
  if (!kept) return {};
  std::vector<std::unique_ptr<StoredWeight>> views;
  begin = 0;
  for (const auto& [end, f] : runs) {
    views.push_back(stored.Rows(begin, end));
    if (views.back() == nullptr) return {};
    begin = end;
  }
  return views;
}

}  // namespace

absl::StatusOr<Weight> CpuBackend::UploadWeight(const float* host, int64_t rows, int64_t cols) {
  return UploadStoredWeight(HostFloats(host, rows, cols));
}

absl::StatusOr<Weight> CpuBackend::UploadStoredWeight(const StoredWeight& stored) {
  const int64_t rows = stored.rows(), cols = stored.cols();
  Weight w;
  w.rows = rows;
  w.cols = cols;
  w.format = rows == 1 ? WeightFormat::kF32 : options_.weight_format;
  if (w.format == WeightFormat::kQ4_1) w.format = KeptFormat(stored);
  if (w.format == WeightFormat::kQ8 && options_.weight_format == WeightFormat::kQ4_1) {
    // Parts kept in their own layouts, the rest q8: one segment per run.
    std::vector<std::unique_ptr<StoredWeight>> runs = KeptRuns(stored);
    for (const std::unique_ptr<StoredWeight>& run : runs) {
      IG_ASSIGN_OR_RETURN(Weight part, UploadStoredWeight(*run));
      w.segments.push_back(std::move(part));
    }
    if (!runs.empty()) return w;
  }
  if ((w.format == WeightFormat::kQ8 || w.format == WeightFormat::kQ4_1 ||
       w.format == WeightFormat::kQ4_0 || w.format == WeightFormat::kQ5_1 ||
       w.format == WeightFormat::kQ5_0) &&
      cols % cpu::kQ8Block != 0) {
    w.format = WeightFormat::kF32;
  }
  if (w.format == WeightFormat::kF16) w.format = WeightFormat::kBF16;  // no f16 kernels on CPU
  const size_t n = static_cast<size_t>(rows * cols);
  size_t bytes = n * 4;
  if (w.format == WeightFormat::kBF16) bytes = n * 2;
  if (w.format == WeightFormat::kQ8) bytes = Q8ScalesOffset(rows, cols) + n / cpu::kQ8Block * 4;
  if (w.format == WeightFormat::kQ4_1) bytes = Q4ScalesOffset(rows, cols) + n / cpu::kQ4Block * 8;
  if (w.format == WeightFormat::kQ4_0) bytes = Q4ScalesOffset(rows, cols) + n / cpu::kQ4Block * 4;
  if (w.format == WeightFormat::kQ5_1) bytes = Q5ScalesOffset(rows, cols) + n / cpu::kQ5Block * 8;
  if (w.format == WeightFormat::kQ5_0) bytes = Q5ScalesOffset(rows, cols) + n / cpu::kQ5Block * 4;
  if (w.format == WeightFormat::kQ6_K) {
    bytes = Q6SuperOffset(static_cast<int64_t>(n)) + n / cpu::kQ6Super * 4;
  }
  auto buf = Allocate(bytes);
  if (!buf.ok()) return buf.status();
  w.buffer = std::move(*buf);
  auto* base = static_cast<uint8_t*>(w.buffer->data());
  if (w.format == WeightFormat::kF32) {
    stored.Decode(0, rows, reinterpret_cast<float*>(base));
    return w;
  }
  if (w.format == WeightFormat::kQ4_1 || w.format == WeightFormat::kQ4_0) {
    kept_blocks_.store(true);
    const cpu::Q4_1Matrix q = Q4View(w);
    stored.ToQ4_1(0, rows, const_cast<uint8_t*>(q.qs), const_cast<float*>(q.d),
                  const_cast<float*>(q.m));
    return w;
  }
  if (w.format == WeightFormat::kQ6_K) {
    kept_blocks_.store(true);
    const cpu::Q6_KMatrix q = Q6View(w);
    stored.ToQ6_K(0, rows, const_cast<uint8_t*>(q.ql), const_cast<uint8_t*>(q.qh),
                  const_cast<int8_t*>(q.s), const_cast<float*>(q.d));
    return w;
  }
  if (w.format == WeightFormat::kQ5_1 || w.format == WeightFormat::kQ5_0) {
    kept_blocks_.store(true);
    const cpu::Q5_1Matrix q = Q5View(w);
    stored.ToQ5_1(0, rows, const_cast<uint8_t*>(q.qs), const_cast<uint32_t*>(q.qh),
                  const_cast<float*>(q.d), const_cast<float*>(q.m));
    return w;
  }
  const int64_t chunk = RowsPerChunk(cols);
  std::vector<float> rows_f32(static_cast<size_t>(std::min(chunk, rows) * cols));
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t r1 = std::min(rows, r0 + chunk);
    stored.Decode(r0, r1, rows_f32.data());
    if (w.format == WeightFormat::kBF16) {
      ConvertFromFloat(rows_f32.data(), DType::kBF16, base + r0 * cols * 2,
                       static_cast<size_t>((r1 - r0) * cols));
    } else {
      cpu::QuantizeQ8(
          rows_f32.data(), r1 - r0, cols, reinterpret_cast<int8_t*>(base + r0 * cols),
          reinterpret_cast<float*>(base + Q8ScalesOffset(rows, cols)) + r0 * cols / cpu::kQ8Block);
    }
  }
  return w;
}

absl::Status CpuBackend::Embedding(const Weight& table, const int32_t* ids, MatView out) {
  if (auto st = CheckF32(out, "Embedding"); !st.ok()) return st;
  if (!table.segments.empty()) {
    return absl::InvalidArgumentError(
        "cpu backend: Embedding of a matrix stacked from parts in different formats");
  }
  switch (table.format) {
    case WeightFormat::kBF16:
      cpu::EmbeddingBf16(static_cast<const uint16_t*>(table.data()), table.cols, ids, out.rows,
                         out.As<float>(), out.stride);
      break;
    case WeightFormat::kQ8:
      cpu::EmbeddingQ8(Q8View(table), ids, out.rows, out.As<float>(), out.stride);
      break;
    case WeightFormat::kQ4_1:
    case WeightFormat::kQ4_0:
      cpu::EmbeddingQ4_1(Q4View(table), ids, out.rows, out.As<float>(), out.stride);
      break;
    case WeightFormat::kQ5_1:
    case WeightFormat::kQ5_0:
      cpu::EmbeddingQ5_1(Q5View(table), ids, out.rows, out.As<float>(), out.stride);
      break;
    case WeightFormat::kQ6_K:
      cpu::EmbeddingQ6_K(Q6View(table), ids, out.rows, out.As<float>(), out.stride);
      break;
    default:
      cpu::Embedding(F(table), table.cols, ids, out.rows, out.As<float>(), out.stride);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::RmsNorm(MatView x, const Weight& weight, float eps, MatView out) {
  if (auto st = CheckF32(x, "RmsNorm"); !st.ok()) return st;
  cpu::RmsNorm(x.As<float>(), x.stride, F(weight), x.rows, x.cols, eps, out.As<float>(),
               out.stride);
  return absl::OkStatus();
}

absl::Status CpuBackend::LayerNorm(MatView x, const Weight& weight, const Weight* bias, float eps,
                                   MatView out) {
  if (auto st = CheckF32(x, "LayerNorm"); !st.ok()) return st;
  cpu::LayerNorm(x.As<float>(), x.stride, F(weight), F(bias), x.rows, x.cols, eps, out.As<float>(),
                 out.stride);
  return absl::OkStatus();
}

absl::Status CpuBackend::Linear(MatView x, const Weight& w, const Weight* bias, MatView out,
                                bool accumulate) {
  if (auto st = CheckF32(x, "Linear"); !st.ok()) return st;
  if (x.cols != w.cols || out.cols != w.rows || out.rows != x.rows) {
    return absl::InvalidArgumentError(absl::StrCat("cpu backend: Linear shapes [", x.rows, ", ",
                                                   x.cols, "] x [", w.rows, ", ", w.cols,
                                                   "]^T -> [", out.rows, ", ", out.cols, "]"));
  }
  if (!w.segments.empty()) {  // each segment's rows into its columns of out
    if (MultiplyBlockParts(x, w, F(bias), out, accumulate)) return absl::OkStatus();
    int64_t r0 = 0;
    for (const Weight& part : w.segments) {
      const float* b = F(bias);
      MultiplyRows(x, part, b == nullptr ? nullptr : b + r0, out.Cols(r0, part.rows), accumulate);
      r0 += part.rows;
    }
    return absl::OkStatus();
  }
  MultiplyRows(x, w, F(bias), out, accumulate);
  return absl::OkStatus();
}

bool CpuBackend::BlockMatrixOf(const Weight& w, cpu::BlockMatrix& m) const {
  switch (w.format) {
    case WeightFormat::kQ8:  // GemmRowsQ8's order only where rows are batch-invariant
      if (!options_.batch_invariant) return false;
      m = Q8View(w);
      return true;
    case WeightFormat::kQ4_1:
    case WeightFormat::kQ4_0:
      m = Q4View(w);
      return true;
    case WeightFormat::kQ5_1:
    case WeightFormat::kQ5_0:
      m = Q5View(w);
      return true;
    case WeightFormat::kQ6_K:
      m = Q6View(w);
      return true;
    default:
      return false;
  }
}

bool CpuBackend::MultiplyBlockParts(MatView x, const Weight& w, const float* bias, MatView out,
                                    bool accumulate) {
  std::array<cpu::BlockPart, cpu::kMaxBlockParts> parts;
  if (w.segments.size() > parts.size()) return false;
  int64_t r0 = 0;
  for (size_t i = 0; i < w.segments.size(); ++i) {
    const Weight& part = w.segments[i];
    cpu::BlockPart& p = parts[i];
    if (!BlockMatrixOf(part, p.matrix)) return false;
    p.bias = bias == nullptr ? nullptr : bias + r0;
    p.y = out.Cols(r0, part.rows).As<float>();
    r0 += part.rows;
  }
  cpu::GemmRowsParts(x.As<float>(), x.stride, {parts.data(), w.segments.size()}, out.stride, x.rows,
                     accumulate);
  return true;
}

void CpuBackend::MultiplyRows(MatView x, const Weight& w, const float* bias, MatView out,
                              bool accumulate) {
  cpu::BlockPart part;
  if (BlockMatrixOf(w, part.matrix)) {
    part.bias = bias;
    part.y = out.As<float>();
    cpu::GemmRowsParts(x.As<float>(), x.stride, {&part, 1}, out.stride, x.rows, accumulate);
    return;
  }
  switch (w.format) {
    case WeightFormat::kBF16:
      if (options_.batch_invariant) {
        cpu::GemmRowsBf16(x.As<float>(), x.stride, static_cast<const uint16_t*>(w.data()), bias,
                          out.As<float>(), out.stride, x.rows, w.rows, w.cols, accumulate);
      } else {
        cpu::GemmBf16(x.As<float>(), x.stride, static_cast<const uint16_t*>(w.data()), bias,
                      out.As<float>(), out.stride, x.rows, w.rows, w.cols, accumulate);
      }
      break;
    case WeightFormat::kQ8:  // rows need not be batch-invariant: the packed order
      cpu::GemmQ8(x.As<float>(), x.stride, Q8View(w), bias, out.As<float>(), out.stride, x.rows,
                  accumulate);
      break;
    default:
      if (options_.batch_invariant) {
        cpu::GemmRowsF32(x.As<float>(), x.stride, F(w), w.cols, bias, out.As<float>(), out.stride,
                         x.rows, w.rows, w.cols, accumulate);
      } else {
        cpu::Gemm(x.As<float>(), x.stride, F(w), w.cols, bias, out.As<float>(), out.stride, x.rows,
                  w.rows, w.cols, accumulate);
      }
  }
}

absl::Status CpuBackend::Rope(MatView x, int num_heads, int head_dim, int rotary_dim,
                              const int32_t* positions, const float* inv_freq,
                              cpu::RopeLayout layout, int64_t inv_freq_head_stride) {
  if (auto st = CheckF32(x, "Rope"); !st.ok()) return st;
  cpu::Rope(x.As<float>(), x.stride, x.rows, num_heads, head_dim, rotary_dim, positions, inv_freq,
            layout, inv_freq_head_stride);
  return absl::OkStatus();
}

absl::Status CpuBackend::ProjectHeads(MatView x, int num_heads, int num_kv_heads, int head_dim,
                                      const float* skew, int partial_dim, MatView out) {
  if (auto st = CheckF32(x, "ProjectHeads"); !st.ok()) return st;
  if (auto st = CheckF32(out, "ProjectHeads"); !st.ok()) return st;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
      x.cols != static_cast<int64_t>(num_heads) * head_dim ||
      out.cols != static_cast<int64_t>(num_heads) * partial_dim || out.rows != x.rows) {
    return absl::InvalidArgumentError("cpu backend: ProjectHeads shapes do not match");
  }
  cpu::ProjectHeads(x.As<float>(), x.stride, x.rows, num_heads, num_kv_heads, head_dim, skew,
                    partial_dim, out.As<float>(), out.stride);
  return absl::OkStatus();
}

absl::Status CpuBackend::SwiGlu(MatView gate, MatView up, MatView out) {
  if (auto st = CheckF32(gate, "SwiGlu"); !st.ok()) return st;
  cpu::SwiGlu(gate.As<float>(), gate.stride, up.As<float>(), up.stride, gate.rows, gate.cols,
              out.As<float>(), out.stride);
  return absl::OkStatus();
}

absl::Status CpuBackend::Relu(MatView x) {
  if (auto st = CheckF32(x, "Relu"); !st.ok()) return st;
  cpu::Relu(x.As<float>(), x.stride, x.rows, x.cols);
  return absl::OkStatus();
}

absl::Status CpuBackend::Add(MatView x, MatView y) {
  if (auto st = CheckF32(x, "Add"); !st.ok()) return st;
  cpu::Add(x.As<float>(), x.stride, x.rows, x.cols, y.As<float>(), y.stride);
  return absl::OkStatus();
}

absl::Status CpuBackend::Copy(MatView src, MatView dst) {
  if (src.rows != dst.rows || src.cols != dst.cols) {
    return absl::InvalidArgumentError("cpu backend: Copy needs equal shapes");
  }
  if (src.dtype == dst.dtype) {
    const size_t row_bytes = src.cols * DTypeSize(src.dtype);
    for (int64_t r = 0; r < src.rows; ++r) {
      std::memcpy(dst.Rows(r, 1).data, src.Rows(r, 1).data, row_bytes);
    }
    return absl::OkStatus();
  }
  // Conversions between float32 and bfloat16 (activations into bf16 K/V rows, and back).
  if (src.dtype == DType::kF32 && dst.dtype == DType::kBF16) {
    for (int64_t r = 0; r < src.rows; ++r) {
      const float* in = src.Rows(r, 1).As<float>();
      uint16_t* out = static_cast<uint16_t*>(dst.Rows(r, 1).data);
      for (int64_t c = 0; c < src.cols; ++c) out[c] = FloatToBf16(in[c]);
    }
    return absl::OkStatus();
  }
  if (src.dtype == DType::kBF16 && dst.dtype == DType::kF32) {
    for (int64_t r = 0; r < src.rows; ++r) {
      const uint16_t* in = static_cast<const uint16_t*>(src.Rows(r, 1).data);
      float* out = dst.Rows(r, 1).As<float>();
      for (int64_t c = 0; c < src.cols; ++c) out[c] = Bf16ToFloat(in[c]);
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "cpu backend: Copy cannot convert ", DTypeName(src.dtype), " to ", DTypeName(dst.dtype)));
}

}  // namespace infinigen
