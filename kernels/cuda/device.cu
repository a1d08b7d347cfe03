#include <cuda_runtime.h>

#include "kernels/cuda/device.h"

namespace infinigen::cuda {

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls are not confused by it
    return 0;
  }
  return count;
}

}  // namespace infinigen::cuda
