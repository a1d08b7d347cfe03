// The bytes of a UCX gather request, apart from UCX so that both ends and the tests share one
// codec: u32 item count, then per item u64 sequence, i32 layer, i64 rows per KV head, i64 index
// count and that many i32 indices ([num_kv_heads, count]), in the hosts' byte order (x86-64 and
// arm64 workers and stores are both little-endian). The store parses requests from the network:
// every length is checked against the bytes received before anything is sized from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace infinigen {

struct WireGatherItem {
  uint64_t seq = 0;
  int32_t layer = 0;
  int64_t count = 0;           // rows per KV head
  std::vector<int32_t> slots;  // [num_kv_heads, count]
};

// Appends one item to a request whose u32 item count the caller writes first (PutItemCount).
void PutItemCount(std::vector<uint8_t>& out, uint32_t items);
void PutGatherItem(std::vector<uint8_t>& out, uint64_t seq, int32_t layer, int64_t count,
                   std::span<const int32_t> slots);

// INVALID_ARGUMENT for a request that is cut short, has bytes left over, or announces more
// items or indices than its bytes hold. Index values are not checked here (the store does).
absl::StatusOr<std::vector<WireGatherItem>> ParseGatherRequest(const uint8_t* data, size_t length);

}  // namespace infinigen
