// The CUDA backend is a plugin (libinfinigen_cuda.so, built beside the binaries) that a process
// loads only when it runs on a GPU: a CPU process maps none of CUDA's libraries, which added
// ~150 MiB to a CPU run's peak resident memory while they were linked in (SmolLM2 q4_1 bench:
// 330.6 -> 180.4 MiB once they were not; docs/benchmarks.md), more than SmolLM2's packed weights.
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
// Bumped whenever Backend's or StoredWeight's virtual functions or Weight's layout change (2:
// ScratchBytes; 3: StoredWeight::ToQ6_K, PartEnds and Rows, Weight::segments; 4:
// StoredWeight::ConvertsToQ5_0 and ConvertsToQ4_0; 5: GatherBlockRows; 6: ForkSideQueue,
// JoinSideQueue, BlockRowsGather::on_side_queue; 7: BlockRowsGather::dst_rows; 8: PlanKeptRows,
// MapKeptRows, BlockRowsGather::list_counts, DecodeAttentionItem::count; 9: KeptRowsPlan::listed,
// added after 8 was taken; 10: DecodeScratchBytes,
// KeptRowsPlan::on_side_queue; 11: UnregisterHostMemory).
inline constexpr int kCudaPluginAbi = 11;

}  // namespace infinigen
