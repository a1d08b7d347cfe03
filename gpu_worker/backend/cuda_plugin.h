// The CUDA backend is a plugin (libinfinigen_cuda.so, built beside the binaries) that a process
// loads only when it runs on a GPU: a CPU process maps none of CUDA's libraries, which cost
// ~150 MiB of resident memory once loaded (cuBLAS and cuBLASLt relocate and touch that much at
// startup), more than SmolLM2's packed weights.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "gpu_worker/backend/backend.h"

namespace infinigen {

// The CUDA backend on GPU `device`, storing activations, weights and K/V in `dtype`. The plugin
// is $INFINIGEN_CUDA_BACKEND when set, else libinfinigen_cuda.so next to the executable, else in
// ../lib from it. FAILED_PRECONDITION saying what is missing when the plugin, CUDA's libraries
// or the device cannot be loaded.
absl::StatusOr<std::unique_ptr<Backend>> LoadCudaBackend(int device, DType dtype);

// The plugin's entry point, by this name with C linkage: a new backend (owned by the caller), or
// nullptr with a message in error. `abi` and `backend_size` must be the loader's kCudaPluginAbi
// and sizeof(Backend), so that a plugin from another build is refused rather than called.
using CreateCudaBackendFn = Backend* (*)(int abi, size_t backend_size, int device, int dtype,
                                         char* error, size_t error_size);
inline constexpr char kCreateCudaBackendSymbol[] = "InfinigenCreateCudaBackend";
inline constexpr int kCudaPluginAbi = 1;

}  // namespace infinigen
