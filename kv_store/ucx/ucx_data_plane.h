// The UCX data plane of the KV store, for workers on other hosts: a gather request goes to the
// store as one UCX active message and the rows come back as one byte stream laid out as the
// worker's buffers are (per item: K rows of every head, then V rows) -- never a message per row.
// A large item travels as two messages (its K rows, its V rows) that the worker receives in
// place, each into one contiguous destination by rendezvous (zero-copy RMA under the hood): a
// scattered receive would make UCX copy every fragment. Small items (a batch's many sequences)
// travel several to a message, received into one buffer and copied out. Connections use peer
// failure detection, so UCX picks network transports (RDMA where the fabric has it, TCP here;
// tests use UCX_NET_DEVICES=lo); workers on the store's host use the shm transport. Control
// calls stay on gRPC.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/kv_store.h"

namespace infinigen {

// Store side: listens on a TCP port for UCX connections and answers gathers from its own
// progress thread.
class UcxGatherServer {
 public:
  static absl::StatusOr<std::unique_ptr<UcxGatherServer>> Start(KvStore& store, int port);
  ~UcxGatherServer();
  int port() const { return port_; }
  // Workers connected now; the endpoint of one that went away is closed within a few
  // milliseconds of UCX noticing.
  int connected_workers() const;

 private:
  UcxGatherServer() = default;
  struct State;
  std::unique_ptr<State> state_;
  int port_ = 0;
};

// Worker side: one endpoint to one store; Gather blocks the calling thread (the client queue)
// until the reply is in the items' buffers or the deadline passes.
class UcxGatherChannel {
 public:
  static absl::StatusOr<std::unique_ptr<UcxGatherChannel>> Connect(const std::string& host,
                                                                   int port);
  ~UcxGatherChannel();
  // Rows land in the items' buffers; on an error none of them is written after the return.
  absl::Status Gather(const std::vector<ClientGatherItem>& items,
                      const std::vector<int64_t>& row_bytes, absl::Duration timeout);
  // The connection failed (peer gone, or a transfer that could not be cancelled): reconnect.
  bool broken() const;

 private:
  UcxGatherChannel() = default;
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace infinigen
