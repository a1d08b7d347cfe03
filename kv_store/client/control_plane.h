// KvControlPlane: the gRPC calls every remote KV transport makes (open, attach, close, append,
// stats, lease renewal, the store's description and block tables), over one channel to the
// store. The data planes (kv_store/client/data_plane.h) carry the gathers' rows: in gRPC replies
// over this same channel, from the store's shared arena (shm), or over UCX.
//
// A call waits (up to half its timeout, at most 500 ms) for a channel that is not connected to
// connect. A channel that lost its store reconnects through attempts whose completion only a
// thread polling the channel notices; fail-fast calls do not poll, and gRPC's backup poller runs
// every 5 s, so without this wait a restarted store was reached only after ~5 s of UNAVAILABLE.
// After a wait that failed, calls fail at once for as long as that wait (the store is gone: a
// step's append and gathers each waiting 1 s made a dead store reach clients only after 2-3 s);
// the next call after that waits again. Calls may come from several threads.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "infinigen/kvstore/v1/kvstore.grpc.pb.h"
#include "kv_store/client/kv_store_client.h"

namespace infinigen {

// What the store says of itself (Describe).
struct StoreDescription {
  uint64_t instance = 0;  // this run of the store
  std::string shm_path;   // its arena, when shared ("" otherwise)
  int64_t arena_bytes = 0;
  int64_t block_bytes = 0;
  int ucx_port = 0;          // its UCX data plane (0: none)
  bool ucx_appends = false;  // which takes append batches too
  std::string staging_dir;   // where appends' rows may be staged ("": nowhere)
};

// One layer's block table of a sequence (where its rows lie in the store's arena).
struct StoreBlockTable {
  uint64_t instance = 0;  // the run of the store whose arena the blocks are in
  int64_t rows = 0, row_bytes = 0, blocks_per_head = 0;
  std::vector<int32_t> k_blocks, v_blocks;  // [heads, blocks_per_head]
};

// One append of rows [start, start + n) of a layer (k, v: [n, num_kv_heads, head_dim]).
struct StoreAppend {
  StoreSequenceId seq;
  int layer;
  int64_t start, n;
  std::span<const uint8_t> k, v;
  std::span<const int32_t> slots;  // a KV pool's slots (KvStore::Append), or none
  // >= 0: k's and then v's bytes are at this offset of AppendBatch's staging file instead.
  int64_t staged_offset = -1;
};

// An AppendBatch call's request (each staged append's rows at its staged_offset), and each
// append's status from the call's own status and its answer (the UCX data plane sends the same
// messages).
kvstore::v1::AppendBatchRequest AppendBatchRequestOf(const std::vector<StoreAppend>& appends,
                                                     const std::string& staging_file = "",
                                                     const std::string& released_staging_file = "");
std::vector<absl::Status> AppendStatuses(const absl::Status& call,
                                         const kvstore::v1::AppendBatchResponse& answer,
                                         size_t appends);

class KvControlPlane {
 public:
  KvControlPlane(const KvClientConfig& config,
                 std::shared_ptr<grpc::ChannelCredentials> credentials);

  const std::string& address() const { return config_.address; }

  absl::StatusOr<StoreDescription> Describe(absl::Duration timeout);
  // The store's instance on success (a restarted store has another).
  absl::StatusOr<uint64_t> Open(StoreSequenceId seq, const SequenceSpec& spec);
  struct Attached {
    int64_t length = 0;
    uint64_t instance = 0;
  };
  // `fork`: copy `from` instead of taking it over (KvStore::Fork).
  absl::StatusOr<Attached> Attach(StoreSequenceId from, StoreSequenceId to,
                                  const SequenceSpec& spec, int64_t max_length, bool fork);
  absl::Status Close(StoreSequenceId seq);
  absl::Status Release(StoreSequenceId seq);
  absl::Status Append(const StoreAppend& a);
  // One call for several appends; the store applies each on its own: each one's status.
  // `staging_file`: the file the staged appends' rows are in ("" if none is). `call` (may be
  // null): the call's own status (a failed call fails every append; a late one may still be
  // applied, reading the staging file).
  std::vector<absl::Status> AppendBatch(const std::vector<StoreAppend>& appends,
                                        const std::string& staging_file = "",
                                        absl::Status* call = nullptr,
                                        const std::string& released_staging_file = "");
  absl::StatusOr<KvStoreStats> Stats();
  absl::Status Renew(const std::string& owner);
  absl::StatusOr<StoreBlockTable> Blocks(StoreSequenceId seq, int layer);
  // A gather answered in the reply (the gRPC data plane).
  absl::Status Gather(const kvstore::v1::GatherRequest& request,
                      kvstore::v1::GatherResponse* response);

 private:
  // Sets the call's deadline, then waits for a channel that is not connected (file comment).
  void Prepare(grpc::ClientContext& ctx, absl::Duration timeout);

  const KvClientConfig config_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<kvstore::v1::KvStore::Stub> stub_;
  absl::Mutex reconnect_mu_;
  absl::Time no_wait_until_ ABSL_GUARDED_BY(reconnect_mu_) = absl::InfinitePast();
};

}  // namespace infinigen
