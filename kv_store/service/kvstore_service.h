// The gRPC face of the KV store: translates infinigen.kvstore.v1 messages to KvStore calls and
// back, nothing else.
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "absl/time/time.h"
#include "infinigen/kvstore/v1/kvstore.grpc.pb.h"
#include "kv_store/kv_store.h"
#include "kv_store/staging_file.h"

namespace infinigen {

// The largest message the server takes or sends (main.cc sets both); a Gather whose rows would
// exceed it is refused before anything is allocated for them.
inline constexpr size_t kMaxKvMessageBytes = size_t{256} << 20;

class KvStoreService final : public kvstore::v1::KvStore::Service {
 public:
  using Clock = std::function<absl::Time()>;
  explicit KvStoreService(KvStore& store, Clock clock = absl::Now);

  grpc::Status Open(grpc::ServerContext*, const kvstore::v1::OpenRequest*,
                    kvstore::v1::OpenResponse*) override;
  grpc::Status Append(grpc::ServerContext*, const kvstore::v1::AppendRequest*,
                      kvstore::v1::AppendResponse*) override;
  grpc::Status AppendBatch(grpc::ServerContext*, const kvstore::v1::AppendBatchRequest*,
                           kvstore::v1::AppendBatchResponse*) override;
  grpc::Status Gather(grpc::ServerContext*, const kvstore::v1::GatherRequest*,
                      kvstore::v1::GatherResponse*) override;
  grpc::Status Attach(grpc::ServerContext*, const kvstore::v1::AttachRequest*,
                      kvstore::v1::AttachResponse*) override;
  grpc::Status Close(grpc::ServerContext*, const kvstore::v1::CloseRequest*,
                     kvstore::v1::CloseResponse*) override;
  grpc::Status Release(grpc::ServerContext*, const kvstore::v1::ReleaseRequest*,
                       kvstore::v1::ReleaseResponse*) override;
  grpc::Status Renew(grpc::ServerContext*, const kvstore::v1::RenewRequest*,
                     kvstore::v1::RenewResponse*) override;
  grpc::Status Stats(grpc::ServerContext*, const kvstore::v1::StatsRequest*,
                     kvstore::v1::StatsResponse*) override;
  grpc::Status Describe(grpc::ServerContext*, const kvstore::v1::DescribeRequest*,
                        kvstore::v1::DescribeResponse*) override;
  grpc::Status Blocks(grpc::ServerContext*, const kvstore::v1::BlocksRequest*,
                      kvstore::v1::BlocksResponse*) override;

  // The port of the UCX data plane, advertised by Describe (0: none), and whether it takes
  // appends (AppendBatchWithRows as its UcxAppendHandler).
  void set_ucx_port(int port, bool appends = false) {
    ucx_port_ = port;
    ucx_appends_ = appends;
  }
  // An AppendBatch whose rows came in one message after it (the UCX data plane): `request` an
  // AppendBatchRequest's bytes, each append's rows at its staged_offset of `rows`. The
  // AppendBatchResponse's bytes, or INVALID_ARGUMENT for a request that does not parse or
  // names a staging file.
  absl::StatusOr<std::string> AppendBatchWithRows(std::span<const uint8_t> request,
                                                  std::span<const uint8_t> rows);
  // Random per service object (per run of the store process), told to clients so that a shm
  // client notices a restarted store and maps its new arena.
  uint64_t instance() const { return instance_; }

 private:
  // One append of `req`'s rows, k and v of `bytes` bytes each (its own, or a staging file's).
  grpc::Status AppendRows(const kvstore::v1::AppendRequest& req, const uint8_t* k, const uint8_t* v,
                          size_t bytes, kvstore::v1::AppendResponse* resp);
  // Applies each append of `req` on its own (AppendBatchResponse's failures); staged rows are
  // read from `staged` (`where`: what it is, for errors), none if there is no such place.
  void ApplyAppendBatch(const kvstore::v1::AppendBatchRequest& req,
                        std::optional<std::span<const uint8_t>> staged, const char* where,
                        kvstore::v1::AppendBatchResponse* resp);

  std::atomic<int> ucx_port_{0};
  std::atomic<bool> ucx_appends_{false};
  KvStore& store_;
  Clock clock_;
  const uint64_t instance_;
  // Collocated clients' staged appends (AppendBatchRequest.staging_file), in the shared arena's
  // folder (none where the arena is not shared).
  StagingFiles staging_;
};

}  // namespace infinigen
