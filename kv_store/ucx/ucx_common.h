// What both ends of the UCX data plane share: a ucp context and worker set up alike, endpoints
// closed alike, UCX errors as statuses, and the bounds of a gather's pieces.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>

#include "absl/status/status.h"

namespace infinigen {

// A gather reply is gathered and sent in pieces of about this size (RequestHeader::piece_bytes).
inline constexpr uint64_t kMinPiece = 64 << 10, kMaxPiece = 64 << 20;

absl::Status UcsError(const char* what, ucs_status_t s);
// A ucp context and worker with active messages and wakeup support (one thread uses them).
absl::Status InitUcxWorker(ucp_context_h* context, ucp_worker_h* worker);
// Calls `cb(arg, ...)` for the worker's active messages of `id`.
absl::Status SetUcxAmHandler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb,
                             void* arg);
// Closes by force (completing every request on it) and waits for the close.
void CloseUcxEndpoint(ucp_worker_h worker, ucp_ep_h ep);

}  // namespace infinigen
