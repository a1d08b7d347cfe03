// What CUDA devices this process can use. Safe to call on machines without a GPU or driver.
#pragma once

namespace infinigen::cuda {

// Number of usable CUDA devices; 0 when there is no GPU, no driver, or the runtime fails.
int DeviceCount();

}  // namespace infinigen::cuda
