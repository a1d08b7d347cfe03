// The UCX data plane of a worker on another host than the store: each gather is one UCX request
// and one reply (kv_store/ucx/ucx_data_plane.h), over RDMA where the fabric has it, and so is
// each append batch where the store takes appends over UCX (its description says so): the
// AppendBatchRequest with the rows staged after it in one message, instead of inside protobuf
// over gRPC. The store advertises its UCX port in its description; a broken connection (the
// store restarted, a transfer abandoned) is made again at the next call. The gathers (queue
// thread) and the appends (append thread) each have a channel of their own: a UCX worker is
// one thread's. Built only with UCX.
#include <atomic>
#include <cstring>
#include <span>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_store/client/data_plane.h"
#include "kv_store/ucx/ucx_data_plane.h"
#include "kv_store/ucx/ucx_wire.h"

namespace infinigen {
namespace {

namespace pb = kvstore::v1;

class UcxDataPlane final : public KvDataPlane {
 public:
  UcxDataPlane(KvControlPlane& control, const KvClientConfig& config)
      : control_(control),
        connect_timeout_(config.connect_timeout),
        call_timeout_(config.call_timeout) {}

  std::string name() const override { return "ucx"; }

  // At creation, before the client's threads start: both channels wired up now, not in a
  // stream's first call (a connection's wire-up measured 650 ms on loopback TCP).
  absl::Status Connect() override {
    IG_ASSIGN_OR_RETURN(channel_, Dial());
    if (takes_appends_.load()) {  // a failure here is the append thread's to retry
      absl::StatusOr<std::unique_ptr<UcxDataChannel>> appends = Dial();
      if (appends.ok()) append_channel_ = *std::move(appends);
    }
    return absl::OkStatus();
  }

  absl::Status Gather(const std::vector<ClientGatherItem>& items, const OpenSpecs& specs) override {
    IG_ASSIGN_OR_RETURN(const std::vector<int64_t> row_bytes, CopiedRowBytes(items, specs, name()));
    IG_RETURN_IF_ERROR(Reconnect(channel_));
    return channel_->Gather(items, row_bytes, call_timeout_);
  }

  // One message: the request, each append's K then V rows after it (at its staged_offset of
  // them), copied together. A batch over the message limit, or a store that takes no appends over
  // UCX, goes over gRPC.
  std::optional<std::vector<absl::Status>> AppendBatch(
      const std::vector<StoreAppend>& appends) override {
    if (!takes_appends_.load()) return std::nullopt;
    std::vector<StoreAppend> staged = appends;
    size_t rows = 0;
    for (StoreAppend& a : staged) {
      if (a.k.size() != a.v.size()) return std::nullopt;  // the store says what is wrong
      a.staged_offset = static_cast<int64_t>(rows);
      rows += 2 * a.k.size();
    }
    const pb::AppendBatchRequest request = AppendBatchRequestOf(staged);
    const size_t request_bytes = request.ByteSizeLong();
    if (request_bytes + rows > kMaxUcxAppendBytes) return std::nullopt;
    if (message_.size() < request_bytes + rows) message_.resize(request_bytes + rows);
    request.SerializeWithCachedSizesToArray(message_.data());
    uint8_t* at = message_.data() + request_bytes;
    for (const StoreAppend& a : appends) {
      if (!a.k.empty()) std::memcpy(at, a.k.data(), a.k.size());
      if (!a.v.empty()) std::memcpy(at + a.k.size(), a.v.data(), a.v.size());
      at += 2 * a.k.size();
    }
    absl::Status call = Reconnect(append_channel_);
    // The store described itself again there: one that no longer takes appends over UCX (a
    // rollback, a restart without --ucx_port) gets this batch over gRPC, nothing of it sent yet.
    if (!takes_appends_.load()) return std::nullopt;
    pb::AppendBatchResponse answer;
    if (call.ok()) {
      absl::StatusOr<std::string> bytes = append_channel_->AppendBatch(
          std::span<const uint8_t>(message_.data(), request_bytes + rows), request_bytes,
          call_timeout_);
      if (!bytes.ok()) {
        call = bytes.status();
      } else if (!answer.ParseFromString(*bytes)) {
        call = absl::InternalError("the KV store's answer to an append batch does not parse");
      }
    }
    return AppendStatuses(call, answer, appends.size());
  }

 private:
  // A channel to the store's UCX data plane, which it describes (and whether it takes appends).
  absl::StatusOr<std::unique_ptr<UcxDataChannel>> Dial() {
    IG_ASSIGN_OR_RETURN(const StoreDescription d, control_.Describe(connect_timeout_));
    takes_appends_.store(d.ucx_port != 0 && d.ucx_appends);
    if (d.ucx_port == 0) {
      return absl::FailedPreconditionError(
          "the KV store serves no UCX data plane (start it with --ucx_port)");
    }
    const std::string& address = control_.address();
    return UcxDataChannel::Connect(address.substr(0, address.rfind(':')), d.ucx_port);
  }
  absl::Status Reconnect(std::unique_ptr<UcxDataChannel>& channel) {
    if (channel != nullptr && !channel->broken()) return absl::OkStatus();
    channel.reset();
    absl::StatusOr<std::unique_ptr<UcxDataChannel>> c = Dial();
    if (!c.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "the UCX data plane of the KV store is unreachable: ", c.status().message()));
    }
    channel = *std::move(c);
    return absl::OkStatus();
  }

  KvControlPlane& control_;
  const absl::Duration connect_timeout_;
  const absl::Duration call_timeout_;
  std::atomic<bool> takes_appends_{false};          // as the store last described itself
  std::unique_ptr<UcxDataChannel> channel_;         // queue thread: gathers
  std::unique_ptr<UcxDataChannel> append_channel_;  // append thread: append batches
  std::vector<uint8_t> message_;                    // append thread: the last batch's message
};

}  // namespace

std::unique_ptr<KvDataPlane> MakeUcxDataPlane(KvControlPlane& control,
                                              const KvClientConfig& config) {
  return std::make_unique<UcxDataPlane>(control, config);
}

}  // namespace infinigen
