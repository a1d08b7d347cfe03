// What the CUDA backend's source files share (cuda_backend.cc, cuda_attention.cc): conversions
// to the kernels' types, CUDA and cuBLAS errors as Status, the cuBLAS handle. Not for other users.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gpu_worker/backend/cuda_backend.h"
#include "kernels/cuda/ops.h"

namespace infinigen {
namespace cuda_backend_internal {

static_assert(static_cast<int>(cuda::Elem::kF32) == static_cast<int>(DType::kF32) &&
                  static_cast<int>(cuda::Elem::kF16) == static_cast<int>(DType::kF16) &&
                  static_cast<int>(cuda::Elem::kBF16) == static_cast<int>(DType::kBF16),
              "cuda::Elem and DType must agree");

inline cuda::Elem ToElem(DType t) { return static_cast<cuda::Elem>(t); }
inline cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

// A cudaError_t as a Status: cudaErrorInvalidValue from our own kernels means a shape they do
// not support; anything else is the runtime's failure.
inline absl::Status Check(cudaError_t err, const char* op) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a non-sticky error so that the next operation is not blamed
  if (err == cudaErrorInvalidValue) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: ", op, " does not support these shapes or types"));
  }
  return absl::InternalError(
      absl::StrCat("cuda backend: ", op, " failed: ", cudaGetErrorString(err)));
}

inline absl::Status CheckBlas(cublasStatus_t st, const char* op) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("cuda backend: cuBLAS ", op, " failed: ", cublasGetStatusString(st)));
}

inline cudaDataType_t BlasType(DType t) {
  switch (t) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

inline cuda::Mat M(const MatView& m) { return {m.data, ToElem(m.dtype), m.rows, m.cols, m.stride}; }

}  // namespace cuda_backend_internal

struct CudaBackend::Handles {
  cublasHandle_t blas = nullptr;
  ~Handles() {
    if (blas != nullptr) cublasDestroy(blas);
  }
};

}  // namespace infinigen
