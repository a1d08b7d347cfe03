// KvDataPlane: how a remote KV client's gathers get their rows, one class per transport, each in
// its own file: gRPC replies over the control channel (grpc_data_plane.cc), the collocated
// store's shared arena mapped here (shm_data_plane.cc), UCX (ucx_client_data_plane.cc, built
// with UCX only; kv_store/client/transports.h declares their makers). Everything else goes over
// the control plane (control_plane.h); RemoteKvClient (remote_client.cc) ties the two together.
// Gather runs on the client's queue thread, Appended and AppendBatch on its append thread; the
// rest on the queue thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "kv_store/client/control_plane.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/client/staging_ring.h"
#include "kv_store/client/transports.h"

namespace infinigen {

// The sequences open on a client, as they are stored.
using OpenSpecs = absl::flat_hash_map<StoreSequenceId, SequenceSpec>;

class KvDataPlane {
 public:
  virtual ~KvDataPlane() = default;
  virtual std::string name() const = 0;  // the transport's name: grpc, shm, ucx
  // Reaches the store's data plane (at creation; UCX again after a broken connection).
  virtual absl::Status Connect() = 0;
  // A sequence was opened or attached, answered by the store's run `instance` (shm: a restarted
  // store's arena is mapped here).
  virtual absl::Status Opened(uint64_t instance) { return absl::OkStatus(); }
  virtual void Closed(StoreSequenceId seq) {}
  // Rows [0, rows) of `layer` of `seq` are in the store since an append ended there
  // (kAppendFailed: an append failed, so the store may have lost or moved them).
  static constexpr int64_t kAppendFailed = -2;
  virtual void Appended(StoreSequenceId seq, int layer, int64_t rows) {}
  virtual absl::Status Gather(const std::vector<ClientGatherItem>& items,
                              const OpenSpecs& specs) = 0;
  // Where appends' rows may be staged for the store to copy (AppendBatch's staging_file; shm
  // only), or null: AppendAsync writes them there (any thread: thread-safe), else the append
  // thread where they fit. After a call that failed (the store may still read the file late)
  // RenewAppendStaging gives a new file (append thread).
  virtual std::shared_ptr<StagingRing> append_staging() { return nullptr; }
  // `stop`: no more staging (the store refused the folder: a restarted store's may be another).
  virtual void RenewAppendStaging(bool stop = false) {}
  // The file staging moved on from (for the store to let go of), once: "" if none. Append
  // thread.
  virtual std::string TakeReleasedStaging() { return ""; }
  // Sends an append batch over the data plane (UCX, when the store takes it there): each
  // append's status; nullopt: it goes over the control plane. Append thread.
  virtual std::optional<std::vector<absl::Status>> AppendBatch(
      const std::vector<StoreAppend>& appends) {
    return std::nullopt;
  }
  virtual bool reads_in_place() const { return false; }
  virtual KvStoreClient::Span mapped_memory() const { return {}; }
};

// What the copying data planes check of an item before sizing its rows: the sequence is open
// here and the item asks for bytes, not addresses. Each item's row bytes, or the error.
absl::StatusOr<std::vector<int64_t>> CopiedRowBytes(const std::vector<ClientGatherItem>& items,
                                                    const OpenSpecs& specs,
                                                    const std::string& transport);

}  // namespace infinigen
