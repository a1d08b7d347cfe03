// The UCX data plane of the KV store, for workers on other hosts: the rows of gathers and of
// appends. A gather request goes to the store as one UCX active message and the rows come back as
// one byte stream laid out as the worker's buffers are (per item: K rows of every head, then V
// rows) -- never a message per row. A large item travels as two messages (its K rows, its V rows)
// that the worker receives in place, each into one contiguous destination by rendezvous (zero-copy
// RMA under the hood): a scattered receive would make UCX copy every fragment. Small items (a
// batch's many sequences) travel several to a message, received into one buffer and copied out.
// Connections use peer failure detection, so UCX picks network transports (RDMA where the fabric
// has it, TCP here; tests use UCX_NET_DEVICES=lo); workers on the store's host use the shm
// transport. An append batch travels as one message too: the AppendBatchRequest's bytes, its rows
// staged after them (rendezvous for a large one), answered with the AppendBatchResponse's bytes;
// over gRPC a prompt's K/V went through protobuf at a third of a GB/s. Other control calls stay on
// gRPC.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/kv_store.h"

namespace infinigen {

// Applies one append batch: `request` (an AppendBatchRequest's bytes, each append's rows at its
// staged_offset of `rows`) -> the AppendBatchResponse's bytes, or the error of the whole call.
using UcxAppendHandler = std::function<absl::StatusOr<std::string>(std::span<const uint8_t> request,
                                                                   std::span<const uint8_t> rows)>;

// Store side: listens on a TCP port for UCX connections and answers gathers, and appends if it
// has `on_append`, from its own progress thread.
class UcxDataServer {
 public:
  static absl::StatusOr<std::unique_ptr<UcxDataServer>> Start(KvStore& store, int port,
                                                              UcxAppendHandler on_append = {});
  ~UcxDataServer();
  int port() const { return port_; }
  // Append batches answered over UCX (applied or refused as a whole).
  int64_t append_batches() const;
  // Reply buffers made so far (mapped with UCX, or allocated where that fails): gathers reuse
  // them (at most 4 kept idle), a growing sequence's for many steps.
  int64_t reply_buffers_mapped() const;
  // Workers connected now; the endpoint of one that went away is closed within a few
  // milliseconds of UCX noticing.
  int connected_workers() const;

 private:
  UcxDataServer() = default;
  struct State;
  std::unique_ptr<State> state_;
  int port_ = 0;
};

// Worker side: one endpoint to one store, used by one thread (the client's queue thread gathers,
// its append thread appends: a channel each). Each call blocks until its answer is in or the
// deadline passes.
class UcxDataChannel {
 public:
  static absl::StatusOr<std::unique_ptr<UcxDataChannel>> Connect(const std::string& host, int port);
  ~UcxDataChannel();
  // Rows land in the items' buffers; on an error none of them is written after the return.
  absl::Status Gather(const std::vector<ClientGatherItem>& items,
                      const std::vector<int64_t>& row_bytes, absl::Duration timeout);
  // Sends `message` (an AppendBatchRequest's `request_bytes` bytes, then the rows it stages) and
  // waits for the store's answer: the AppendBatchResponse's bytes, or the call's error (a call
  // that timed out may still have been applied). UCX reads `message` no more once it returns.
  // One contiguous buffer: UCX 1.13 sends an iov of pieces eagerly, in copied fragments (0.75
  // against 1.1-1.3 GB/s for the copy into one buffer and a rendezvous, measured on loopback).
  absl::StatusOr<std::string> AppendBatch(std::span<const uint8_t> message, size_t request_bytes,
                                          absl::Duration timeout);
  // The connection failed (peer gone, or a transfer that could not be cancelled): reconnect.
  bool broken() const;

 private:
  UcxDataChannel() = default;
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace infinigen
