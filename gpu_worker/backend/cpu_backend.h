// The reference backend: float32 activations and K/V in host memory, kernels/cpu for compute,
// OpenBLAS for GEMM. Runs everywhere; the CUDA backend is tested against it.
#pragma once

#include <atomic>
#include <vector>

#include "gpu_worker/backend/backend.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/row_gemm.h"
#include "kernels/cpu/team.h"

namespace infinigen {

struct CpuBackendOptions {
  int num_threads = 0;  // 0: OMP_NUM_THREADS, else every core this process may run on
  // Storage of weight matrices. f32 is exact (the reference); bf16 and q8 trade a little
  // accuracy for 2x / ~3.8x fewer bytes per decode step; q4_1 keeps a GGUF file's 4- and 5-bit
  // matrices' values as they are: Q4_0, Q4_1 and Q4_K in Q4_1 blocks (~5.3x fewer than f32),
  // Q5_0, Q5_1 and Q5_K in Q5_1 blocks (~4.6x), Q6_K and Q3_K in the CPU's Q6_K layout (~4.8x), the
  // others in q8. Matrices whose rows are not a multiple of 32 stay f32 under q8 and q4_1.
  WeightFormat weight_format = WeightFormat::kF32;
  // Every row of a Linear computed by the same fixed-order kernel whatever the batch
  // (kernels/cpu/row_gemm.h; q8: activations quantized per row): a sequence's logits do not
  // depend on which sequences share its step. false: OpenBLAS for several rows (faster
  // prefill, results that vary with the batch).
  bool batch_invariant = true;
  // Storage of K/V rows: f32 (exact), or bf16 (half the bytes a long-context decode step reads;
  // every K/V row rounded once as it is stored, and read back widened exactly).
  DType kv_dtype = DType::kF32;
  // Whether the kernels' threads each stay on one core (kernels/cpu/team.h).
  cpu::Pinning pinning = cpu::Pinning::kAuto;
};

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options = {});

  std::string Name() const override;
  DType activation_dtype() const override { return DType::kF32; }
  DType kv_dtype() const override { return options_.kv_dtype; }
  size_t FreeMemory() const override;
  bool host_accessible() const override { return true; }

  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(const void* host, void* device, size_t bytes) override;
  absl::Status CopyToHost(const void* device, void* host, size_t bytes) override;
  absl::Status Synchronize() override {
    CountSynchronization();
    return absl::OkStatus();
  }
  // Host memory: done now (and no wait counted).
  absl::Status CopyToHostLater(const void* device, void* host, size_t bytes) override;

  absl::StatusOr<Weight> UploadWeight(const float* host, int64_t rows, int64_t cols) override;
  // Reads `stored` a block of rows at a time; under q4_1, a matrix that converts to Q4_1, Q5_1 or
  // Q6_K blocks is converted without passing through float32.
  absl::StatusOr<Weight> UploadStoredWeight(const StoredWeight& stored) override;

  absl::Status Embedding(const Weight& table, const int32_t* ids, MatView out) override;
  absl::Status RmsNorm(MatView x, const Weight& weight, float eps, MatView out) override;
  absl::Status LayerNorm(MatView x, const Weight& weight, const Weight* bias, float eps,
                         MatView out) override;
  absl::Status Linear(MatView x, const Weight& w, const Weight* bias, MatView out,
                      bool accumulate) override;
  absl::Status Rope(MatView x, int num_heads, int head_dim, int rotary_dim,
                    const int32_t* positions, const float* inv_freq, cpu::RopeLayout layout,
                    int64_t inv_freq_head_stride = 0) override;
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
  // InfiniGen's choice (cpu_row_choice.cc): the host policy's arithmetic (kernels/cpu/selection.h).
  absl::Status AppendPartialKeys(MatView k, const float* skew, const PartialKeysShape& shape,
                                 void* keys, int64_t first_row) override;
  absl::Status ChooseRows(const RowChoiceRequest& request, void* workspace) override;
  // The plain loop BlockRowsGather describes (cpu_block_gather.cc): the CUDA kernel's reference.
  absl::Status GatherBlockRows(const BlockRowsGather& g) override;
  // The plain loops KeptRowsPlan and KeptRowsMap describe, and decode attention over a count in
  // its memory (cpu_kept_rows.cc).
  absl::Status PlanKeptRows(const KeptRowsPlan& p) override;
  absl::Status MapKeptRows(const KeptRowsMap& m) override;
  absl::Status AttentionDecodeBatch(std::span<const DecodeAttentionItem> items,
                                    const AttentionShape& shape) override;

 private:
  // Linear's product for a weight of one format (bias: null or out.cols floats).
  void MultiplyRows(MatView x, const Weight& w, const float* bias, MatView out, bool accumulate);
  // Linear's product for a weight in parts of block formats (w.segments) as one parallel job
  // (cpu::GemmRowsParts: the same bits as each part alone); false, having done nothing, where a
  // part has another format.
  bool MultiplyBlockParts(MatView x, const Weight& w, const float* bias, MatView out,
                          bool accumulate);
  // The block-format view of `w` that cpu::GemmRowsParts multiplies, or false: f32 and bf16,
  // and Q8 where rows need not be batch-invariant (GemmQ8's packed order).
  bool BlockMatrixOf(const Weight& w, cpu::BlockMatrix& m) const;

  CpuBackendOptions options_;
  // Whether a weight was kept in Q4_1, Q5_1 or Q6_K blocks (under q4_1, a checkpoint without 4-,
  // 5- or 6-bit GGUF matrices runs q8).
  std::atomic<bool> kept_blocks_{false};
  // INVALID_ARGUMENT naming `op` unless m holds float32 activations.
  static absl::Status CheckF32(const MatView& m, const char* op);
  // AttentionDecode's arguments checked (f32 queries, f32 or bf16 K/V) as the kernels take them.
  absl::StatusOr<cpu::DecodeQuery> DecodeQueryOf(MatView q, KvView k, KvView v,
                                                 const int32_t* indices, int64_t num_rows,
                                                 MatView out);

  // AttentionDecodeBatch's queries and their row lists cut to their counts (grow only: a decode
  // step allocates nothing once warm). One engine thread runs a backend's work at a time.
  std::vector<cpu::DecodeQuery> decode_queries_;
  std::vector<int32_t> packed_indices_;
};

}  // namespace infinigen
