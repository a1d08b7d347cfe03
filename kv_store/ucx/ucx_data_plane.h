// The UCX data plane of the KV store: a gather request goes to the store as one UCX active
// message and the rows of every item come back as one reply message (eager for small replies,
// rendezvous, i.e. zero-copy RMA under the hood, for large ones) -- never a message per row.
// Over RDMA where the fabric has it, TCP or shared memory otherwise (UCX picks; tests use
// UCX_NET_DEVICES=lo). Control calls stay on gRPC.
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

 private:
  UcxGatherServer() = default;
  struct State;
  std::unique_ptr<State> state_;
  int port_ = 0;
};

// Worker side: one endpoint to one store; Gather blocks the calling thread (the client queue)
// until the reply lands in the items' buffers or the deadline passes.
class UcxGatherChannel {
 public:
  static absl::StatusOr<std::unique_ptr<UcxGatherChannel>> Connect(const std::string& host,
                                                                   int port);
  ~UcxGatherChannel();
  absl::Status Gather(const std::vector<ClientGatherItem>& items,
                      const std::vector<int64_t>& row_bytes, absl::Duration timeout);

 private:
  UcxGatherChannel() = default;
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace infinigen
