// CpuBackend::GatherBlockRows: the plain loop over lists and rows that BlockRowsGather
// describes, the reference the CUDA kernel is tested against (tests/gpu/cuda_backend_test.cc).
#include <algorithm>
#include <cstring>

#include "common/status_macros.h"
#include "gpu_worker/backend/cpu_backend.h"

namespace infinigen {

absl::Status CpuBackend::GatherBlockRows(const BlockRowsGather& g) {
  IG_RETURN_IF_ERROR(CheckBlockRowsGather(g));
  if (g.batch == 0 || g.max_count == 0) return absl::OkStatus();
  const auto* arena = static_cast<const uint8_t*>(g.arena);
  auto* dst = static_cast<uint8_t*>(g.dst);
  const size_t row_bytes = static_cast<size_t>(g.row_bytes);
  const int64_t arena_blocks = static_cast<int64_t>(g.arena_bytes / g.block_bytes);
  int32_t errors = 0;
  for (int b = 0; b < g.batch; ++b) {
    for (int h = 0; h < g.num_kv_heads; ++h) {
      const int64_t list = int64_t{b} * g.num_kv_heads + h;
      int64_t count = g.list_counts != nullptr ? g.list_counts[list]
                      : g.counts != nullptr    ? g.counts[b]
                                               : g.max_count;
      if (count > g.max_count) {  // once a sequence (or a list, with list counts)
        if (h == 0 || g.list_counts != nullptr) ++errors;
        count = g.max_count;
      }
      const int32_t* table = g.tables + list * g.table_capacity;
      const int32_t* slots = g.slots + list * g.slot_capacity;
      const int32_t* dst_rows =
          g.dst_rows != nullptr ? g.dst_rows + list * g.slot_capacity : nullptr;
      for (int64_t j = 0; j < count; ++j) {
        const int64_t d = dst_rows != nullptr ? dst_rows[j] : j;
        if (d < 0 || d >= g.dst_rows_per_list) {  // nowhere to write it
          ++errors;
          continue;
        }
        uint8_t* out = dst + static_cast<size_t>(list * g.dst_rows_per_list + d) * row_bytes;
        const int64_t slot = slots[j];
        const int64_t block = slot >= 0 ? slot / g.rows_per_block : -1;
        const int64_t id = block >= 0 && block < g.table_capacity ? table[block] : -1;
        // A block id is checked against the arena's blocks before it is multiplied.
        const size_t at = id >= 0 && id < arena_blocks
                              ? static_cast<size_t>(id) * g.block_bytes +
                                    static_cast<size_t>(slot % g.rows_per_block) * row_bytes
                              : g.arena_bytes;
        if (at + row_bytes > g.arena_bytes) {
          ++errors;
          std::memset(out, 0, row_bytes);
          continue;
        }
        std::memcpy(out, arena + at, row_bytes);
      }
    }
  }
  if (g.errors != nullptr) *g.errors += errors;
  return absl::OkStatus();
}

}  // namespace infinigen
