// RemoteKvClient: the client of a KV store in another process, one control plane (gRPC) plus one
// data plane for the gathers' rows (grpc, shm or ucx: kv_store/client/data_plane.h), over the
// shared queue and renewal machinery (QueuedKvClient).
#include <cstring>
#include <memory>
#include <utility>

#include "common/grpc/tls.h"
#include "common/status_macros.h"
#include "kv_store/client/control_plane.h"
#include "kv_store/client/data_plane.h"
#include "kv_store/client/queued_client.h"
#include "kv_store/client/transports.h"

namespace infinigen {
namespace {

class RemoteKvClient final : public QueuedKvClient {
 public:
  RemoteKvClient(const KvClientConfig& config,
                 std::shared_ptr<grpc::ChannelCredentials> credentials)
      : QueuedKvClient(config),
        control_(std::make_unique<KvControlPlane>(config, std::move(credentials))) {}
  ~RemoteKvClient() override { Stop(); }

  // Reaches the data plane `make` builds, then starts the client's threads.
  absl::Status Connect(DataPlaneMaker make) {
    data_ = make(*control_, config_);
    IG_RETURN_IF_ERROR(data_->Connect());
    Start();
    return absl::OkStatus();
  }

  std::string transport() const override { return data_->name(); }
  bool reads_in_place() const override { return data_->reads_in_place(); }
  Span mapped_memory() const override { return data_->mapped_memory(); }

 protected:
  absl::Status DoOpen(StoreSequenceId seq, const SequenceSpec& spec) override {
    IG_ASSIGN_OR_RETURN(const uint64_t instance, control_->Open(seq, spec));
    IG_RETURN_IF_ERROR(data_->Opened(instance));
    specs_[seq] = spec;
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> DoAttach(StoreSequenceId from, StoreSequenceId to,
                                   const SequenceSpec& spec, int64_t max_length) override {
    IG_ASSIGN_OR_RETURN(const KvControlPlane::Attached a,
                        control_->Attach(from, to, spec, max_length, /*fork=*/false));
    IG_RETURN_IF_ERROR(data_->Opened(a.instance));
    specs_[to] = spec;
    return a.length;
  }

  absl::StatusOr<int64_t> DoFork(StoreSequenceId from, StoreSequenceId to, const SequenceSpec& spec,
                                 int64_t length) override {
    IG_ASSIGN_OR_RETURN(const KvControlPlane::Attached a,
                        control_->Attach(from, to, spec, length, /*fork=*/true));
    IG_RETURN_IF_ERROR(data_->Opened(a.instance));
    specs_[to] = spec;
    return a.length;
  }

  absl::Status DoClose(StoreSequenceId seq) override {
    specs_.erase(seq);
    data_->Closed(seq);
    return control_->Close(seq);
  }

  absl::Status DoRelease(StoreSequenceId seq) override {
    specs_.erase(seq);
    data_->Closed(seq);
    return control_->Release(seq);
  }

  absl::Status DoAppend(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                        const std::vector<uint8_t>& k, const std::vector<uint8_t>& v,
                        const std::vector<int32_t>& slots) override {
    const absl::Status st = control_->Append({seq, layer, start, n, &k, &v, &slots});
    data_->Appended(seq, layer, st.ok() ? start + n : KvDataPlane::kAppendFailed);
    return st;
  }

  // One AppendBatch call for everything that piled up (an Append each costs a round trip),
  // its rows staged where the data plane has a staging file (shm) and they fit in it.
  std::vector<absl::Status> DoAppendBatch(const std::vector<AppendJob>& jobs) override {
    StagingWriter* staging = data_->append_staging();
    if (jobs.size() == 1 && staging == nullptr) {
      const AppendJob& j = jobs[0];
      return {DoAppend(j.seq, j.layer, j.start, j.n, j.k, j.v, j.slots)};
    }
    std::vector<StoreAppend> appends;
    appends.reserve(jobs.size());
    size_t staged = 0;  // bytes written into the staging file
    for (const AppendJob& j : jobs) {
      StoreAppend a{j.seq, j.layer, j.start, j.n, &j.k, &j.v, &j.slots};
      const size_t bytes = j.k.size() + j.v.size();
      if (staging != nullptr && j.k.size() == j.v.size() && !j.k.empty() &&
          bytes <= staging->size() - staged) {
        std::memcpy(staging->data() + staged, j.k.data(), j.k.size());
        std::memcpy(staging->data() + staged + j.k.size(), j.v.data(), j.v.size());
        a.staged_offset = static_cast<int64_t>(staged);
        staged += bytes;
      }
      appends.push_back(a);
    }
    absl::Status call;
    std::vector<absl::Status> statuses =
        control_->AppendBatch(appends, staged > 0 ? staging->path() : std::string(), &call,
                              staged > 0 ? data_->TakeReleasedStaging() : std::string());
    if (staged > 0 && call.ok()) {
      staging->Unlink();  // the store has it mapped
    } else if (staged > 0) {
      // A call that failed may still be applied late, reading the file: the next goes to another
      // (none where the store refused the folder or the name).
      data_->RenewAppendStaging(/*stop=*/absl::IsInvalidArgument(call));
      if (absl::IsNotFound(call) || absl::IsInvalidArgument(call)) {
        // The store refused the file before applying anything (it no longer has it mapped, or
        // cannot open it): the rows go in the call instead.
        for (StoreAppend& a : appends) a.staged_offset = -1;
        statuses = control_->AppendBatch(appends);
      }
    }
    for (size_t i = 0; i < jobs.size(); ++i) {
      data_->Appended(jobs[i].seq, jobs[i].layer,
                      statuses[i].ok() ? jobs[i].start + jobs[i].n : KvDataPlane::kAppendFailed);
    }
    return statuses;
  }

  absl::Status DoGather(const std::vector<ClientGatherItem>& items) override {
    return data_->Gather(items, specs_);
  }
  absl::StatusOr<KvStoreStats> DoStats() override { return control_->Stats(); }
  absl::Status DoRenew() override { return control_->Renew(config_.owner); }

 private:
  std::unique_ptr<KvControlPlane> control_;
  std::unique_ptr<KvDataPlane> data_;  // destroyed before the control plane it uses
  OpenSpecs specs_;                    // queue-thread state
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeRemoteClient(const KvClientConfig& config,
                                                                DataPlaneMaker make) {
  IG_ASSIGN_OR_RETURN(auto credentials, MakeChannelCredentials(config.tls, "--kv_store_tls_"));
  auto client = std::make_unique<RemoteKvClient>(config, std::move(credentials));
  IG_RETURN_IF_ERROR(client->Connect(make));
  return std::unique_ptr<KvStoreClient>(std::move(client));
}

}  // namespace infinigen
