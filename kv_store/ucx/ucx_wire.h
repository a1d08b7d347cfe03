// The UCX data plane's wire format, apart from UCX so that both ends and the tests share it: the
// messages' ids and headers, and the request's bytes: u32 item count, then per item u64
// sequence, i32 layer, i64 rows per KV head, i64 index count and that many i32 indices
// ([num_kv_heads, count]), in the hosts' byte order (x86-64 and arm64 workers and stores are both
// little-endian). The store parses requests from the network: every length is checked against
// the bytes received before anything is sized from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace infinigen {

// Active-message ids: a worker's request, the store's reply.
inline constexpr unsigned kGatherRequest = 1;
inline constexpr unsigned kGatherReply = 2;
// An append batch: AppendHeader, then the AppendBatchRequest's bytes and the rows it stages; the
// reply: a ReplyHeader (offset 0) and the AppendBatchResponse's bytes, or the error's text.
inline constexpr unsigned kAppendRequest = 3;
inline constexpr unsigned kAppendReply = 4;
// The most an append message may hold (the gRPC transport's message limit too).
inline constexpr uint64_t kMaxUcxAppendBytes = uint64_t{256} << 20;

struct AppendHeader {
  uint64_t id;
  uint64_t request_bytes;  // the AppendBatchRequest's; the rows follow it
};

// The header of a request; its payload is the items below.
struct RequestHeader {
  uint64_t id;
  uint64_t piece_bytes;  // the store gathers and sends about this much at a time
};

// The reply of a gather is one byte stream laid out as the worker's buffers are: for each item,
// its K rows of every KV head, then its V rows of every KV head. Each message of the reply lies
// inside one item's K or V, so the worker receives it into one contiguous place (rendezvous then
// lands the bytes in place; a scattered receive would make UCX copy every fragment). The store
// gathers about `piece_bytes` at a time (a few KV heads of one item, K and V) and sends their K
// and their V as two messages.
struct ReplyHeader {
  uint64_t id;
  int32_t code;  // absl::StatusCode; 0 = rows [offset, offset + length) follow, else a message
  int32_t unused;
  uint64_t offset;
};

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
