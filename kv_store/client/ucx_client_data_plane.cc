// The UCX data plane of a worker on another host than the store: each gather is one UCX request
// and one reply (kv_store/ucx/ucx_data_plane.h), over RDMA where the fabric has it. The store
// advertises its UCX port in its description; a broken connection (the store restarted, a
// transfer abandoned) is made again at the next gather. Built only with UCX.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_store/client/data_plane.h"
#include "kv_store/ucx/ucx_data_plane.h"

namespace infinigen {
namespace {

class UcxDataPlane final : public KvDataPlane {
 public:
  UcxDataPlane(KvControlPlane& control, const KvClientConfig& config)
      : control_(control),
        connect_timeout_(config.connect_timeout),
        call_timeout_(config.call_timeout) {}

  std::string name() const override { return "ucx"; }

  absl::Status Connect() override {
    IG_ASSIGN_OR_RETURN(const StoreDescription d, control_.Describe(connect_timeout_));
    if (d.ucx_port == 0) {
      return absl::FailedPreconditionError(
          "the KV store serves no UCX data plane (start it with --ucx_port)");
    }
    const std::string& address = control_.address();
    IG_ASSIGN_OR_RETURN(
        channel_, UcxGatherChannel::Connect(address.substr(0, address.rfind(':')), d.ucx_port));
    return absl::OkStatus();
  }

  absl::Status Gather(const std::vector<ClientGatherItem>& items, const OpenSpecs& specs) override {
    IG_ASSIGN_OR_RETURN(const std::vector<int64_t> row_bytes, CopiedRowBytes(items, specs, name()));
    if (channel_ == nullptr || channel_->broken()) {
      channel_.reset();
      if (absl::Status st = Connect(); !st.ok()) {
        return absl::UnavailableError(
            absl::StrCat("the UCX data plane of the KV store is unreachable: ", st.message()));
      }
    }
    return channel_->Gather(items, row_bytes, call_timeout_);
  }

 private:
  KvControlPlane& control_;
  const absl::Duration connect_timeout_;
  const absl::Duration call_timeout_;
  std::unique_ptr<UcxGatherChannel> channel_;
};

}  // namespace

std::unique_ptr<KvDataPlane> MakeUcxDataPlane(KvControlPlane& control,
                                              const KvClientConfig& config) {
  return std::make_unique<UcxDataPlane>(control, config);
}

}  // namespace infinigen
