// The entry point of libinfinigen_cuda.so (gpu_worker/backend/cuda_plugin.h).
#include <cstdio>
#include <string>

#include "gpu_worker/backend/cuda_backend.h"
#include "gpu_worker/backend/cuda_plugin.h"

extern "C" __attribute__((visibility("default"))) infinigen::Backend* InfinigenCreateCudaBackend(
    int abi, size_t backend_size, int device, int dtype, char* error, size_t error_size) {
  using infinigen::Backend;
  if (abi != infinigen::kCudaPluginAbi || backend_size != sizeof(Backend)) {
    std::snprintf(error, error_size,
                  "the CUDA backend plugin comes from another build (its ABI %d, %zu-byte "
                  "Backend; the binary's %d, %zu): install the plugin built with the binary",
                  infinigen::kCudaPluginAbi, sizeof(Backend), abi, backend_size);
    return nullptr;
  }
  infinigen::CudaBackendOptions options;
  options.device = device;
  options.dtype = static_cast<infinigen::DType>(dtype);
  auto backend = infinigen::CudaBackend::Create(options);
  if (!backend.ok()) {
    std::snprintf(error, error_size, "%s", std::string(backend.status().message()).c_str());
    return nullptr;
  }
  return backend->release();
}
