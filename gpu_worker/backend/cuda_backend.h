// The CUDA backend: activations, weights and resident K/V in GPU memory, kernels/cuda for compute
// and cuBLAS for GEMM, everything on one stream. Storage in f32, f16 or bf16 (weights take the
// activations' type; norm vectors stay f32); accumulation in f32. f32 mode is exact enough to
// reproduce the CPU reference's greedy tokens (cuBLAS without TF32).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/backend/backend.h"

namespace infinigen {

struct CudaBackendOptions {
  int device = 0;
  DType dtype = DType::kBF16;
  // Causal attention of long prompts (from 128 query rows, 16-bit types) through cuBLAS GEMMs
  // and a causal softmax instead of the tiled CUDA-core kernel: 8.9x faster to the first token
  // of a 32K prompt of Llama-3.1-8B on an H200 (docs/benchmarks.md, lease F). The environment's
  // INFINIGEN_CUDA_CAUSAL=tiles turns it off (=gemm on) in every backend the process makes.
  bool gemm_causal_attention = true;
};

class CudaBackend final : public Backend {
 public:
  // FAILED_PRECONDITION when there is no such device or the runtime fails to start on it.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options);
  ~CudaBackend() override;

  std::string Name() const override;
  DType activation_dtype() const override { return options_.dtype; }
  size_t FreeMemory() const override;
  size_t ScratchBytes() const override;
  size_t DecodeScratchBytes(const AttentionShape& shape, int batch) const override;

  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(const void* host, void* device, size_t bytes) override;
  absl::Status CopyToHost(const void* device, void* host, size_t bytes) override;
  absl::Status Synchronize() override;
  absl::Status CopyToHostLater(const void* device, void* host, size_t bytes) override;
  // cudaHostRegister (mapped; read-only where the device supports it, as the KV store's arena
  // is mapped read-only) and GatherRows by one kernel reading the rows over the host link.
  absl::Status RegisterHostMemory(const void* data, size_t bytes) override;
  absl::Status UnregisterHostMemory(const void* data) override;
  absl::Status GatherRows(const void* const* rows, int64_t n, size_t row_bytes, void* dst) override;
  // One kernel over the batch's lists, reading the registered arena by its device alias; the
  // tables, slots and counts never leave the device.
  absl::Status GatherBlockRows(const BlockRowsGather& g) override;
  absl::Status PlanKeptRows(const KeptRowsPlan& p) override;
  absl::Status MapKeptRows(const KeptRowsMap& m) override;
  // The side queue is a second stream (made at the first fork), ordered by events.
  absl::Status ForkSideQueue() override;
  absl::Status JoinSideQueue() override;

  absl::StatusOr<Weight> UploadWeight(const float* host, int64_t rows, int64_t cols) override;

  absl::Status Embedding(const Weight& table, const int32_t* ids, MatView out) override;
  absl::Status RmsNorm(MatView x, const Weight& weight, float eps, MatView out) override;
  absl::Status LayerNorm(MatView x, const Weight& weight, const Weight* bias, float eps,
                         MatView out) override;
  absl::Status Linear(MatView x, const Weight& w, const Weight* bias, MatView out,
                      bool accumulate) override;
  absl::Status Rope(MatView x, int num_heads, int head_dim, int rotary_dim,
                    const int32_t* positions, const float* inv_freq, cpu::RopeLayout layout,
                    int64_t inv_freq_head_stride = 0) override;
  absl::StatusOr<Weight> UploadRandomWeight(int64_t rows, int64_t cols, uint64_t seed,
                                            float scale) override;
  absl::Status ProjectHeads(MatView x, int num_heads, int num_kv_heads, int head_dim,
                            const float* skew, int partial_dim, MatView out) override;
  absl::Status SwiGlu(MatView gate, MatView up, MatView out) override;
  absl::Status Relu(MatView x) override;
  absl::Status Add(MatView x, MatView y) override;
  absl::Status Copy(MatView src, MatView dst) override;
  absl::Status AttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                               const AttentionShape& shape, MatView out) override;
  absl::Status AttentionDecode(MatView q, KvView k, KvView v, const int32_t* indices,
                               int64_t num_rows, const AttentionShape& shape, MatView out,
                               float* weights_out = nullptr) override;
  // One launch for the batch, each item split as AttentionDecode of it alone splits it (the same
  // bits); its per-sequence pointers copied to the device first. Items of different dtypes or
  // row strides run one by one.
  absl::Status AttentionDecodeBatch(std::span<const DecodeAttentionItem> items,
                                    const AttentionShape& shape) override;
  absl::Status AppendPartialKeys(MatView k, const float* skew, const PartialKeysShape& shape,
                                 void* keys, int64_t first_row) override;
  size_t ChooseRowsWorkspaceBytes(int num_heads, int num_kv_heads, int64_t rows) const override;
  absl::Status CheckRowChoiceShape(int num_heads, int num_kv_heads, int partial_dim) const override;
  absl::Status ChooseRows(const RowChoiceRequest& request, void* workspace) override;

  // The stream every operation runs on (a cudaStream_t), for code that adds its own kernels.
  void* stream() const { return stream_; }

 private:
  struct Handles;
  CudaBackend(const CudaBackendOptions& options, std::unique_ptr<Handles> handles, void* stream);
  absl::Status EnsureWorkspace(size_t bytes);
  // AttentionCausal through the tiled CUDA-core kernel: short prompts, float32, or where the
  // GEMMs' scratch cannot be allocated.
  absl::Status TiledAttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                                    const AttentionShape& s, MatView out);
  // AttentionCausal of a long prompt in 16-bit types through cuBLAS: per chunk of query rows and
  // query head, scores = Q K^T (float32), the causal softmax, out = P V.
  absl::Status GemmAttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                                   const AttentionShape& shape, MatView out);

  CudaBackendOptions options_;
  std::unique_ptr<Handles> handles_;
  void* stream_;
  // The side queue's stream and the events that order it against stream_ (cudaStream_t,
  // cudaEvent_t); null until the first ForkSideQueue.
  void* side_stream_ = nullptr;
  void* fork_event_ = nullptr;
  void* join_event_ = nullptr;
  // A scratch buffer outgrown while work queued on the device may still use it is kept here
  // until the backend's next wait (freed with cudaFree then, when the device is idle), so that
  // growing it is no wait in the middle of a step.
  void Retire(std::unique_ptr<Buffer> buffer) {
    if (buffer != nullptr) retired_.push_back(std::move(buffer));
  }
  std::vector<std::unique_ptr<Buffer>> retired_;
  std::unique_ptr<Buffer> workspace_;  // decode attention partials; grows, never per step
  // AttentionDecodeBatch's per-sequence descriptors (cuda::DecodeSeq), on the host and the
  // device; both grow, never per step.
  std::vector<uint8_t> host_decode_seqs_;
  std::unique_ptr<Buffer> decode_seqs_;
  std::unique_ptr<Buffer> scores_;  // GemmAttentionCausal's scores and probabilities
  struct HostRegion {
    const char* host;
    char* device;  // its device alias
    size_t bytes;
  };
  std::vector<HostRegion> host_regions_;
  // The registered region holding [p, p + bytes), or null.
  const HostRegion* RegionOf(const char* p, size_t bytes) const;
  std::vector<const void*> row_table_;  // GatherRows' device addresses, staged here
  std::unique_ptr<Buffer> row_table_device_;
  // Pinned staging of copies to the device. From pageable memory a copy is staged by the
  // driver in buffers of its own, and once those are full the host waits for the stream (what
  // the copies queued before it must wait for): each layer's row tables and indices would
  // wait for the layer before. Two halves in turn: one fills while the copies of the other
  // run; a half is reused once an event says the copies that read it ran (a wait only when
  // the GPU is a whole half behind, counted as a synchronization).
  struct PinnedHalf {
    char* host = nullptr;
    size_t used = 0;
    void* copied = nullptr;  // cudaEvent_t recorded after the last copy from this half
    bool pending = false;
  };
  // Room for `bytes` of pinned memory no queued copy still reads; null when the request is too
  // large (or pinned memory cannot be had): the caller copies from pageable memory.
  char* StageForDevice(size_t bytes);
  PinnedHalf pinned_[2];
  int pinned_at_ = 0;
  bool pinned_failed_ = false;
  // CopyToHostLater's copies land in pinned memory (a copy into pageable memory makes the host
  // wait for it) and are moved to their destinations at the next wait (FinishLaterCopies).
  struct LaterCopy {
    const char* pinned;
    void* host;
    size_t bytes;
  };
  void FinishLaterCopies();
  char* readback_ = nullptr;  // pinned
  size_t readback_capacity_ = 0, readback_used_ = 0;
  size_t readback_wanted_ = 0;  // the most the copies between two waits needed
  size_t readback_asked_ =
      0;  // what they asked for since the last wait CopyToHostLater did not force
  std::vector<LaterCopy> later_;
};

}  // namespace infinigen
