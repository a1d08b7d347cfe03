// RemoteKvClient: the client of a KV store in another process, one control plane (gRPC) plus one
// data plane for the gathers' rows (grpc, shm or ucx: kv_store/client/data_plane.h), over the
// shared queue and renewal machinery (QueuedKvClient).
#include <cstring>
#include <memory>
#include <optional>
#include <span>
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
                        std::span<const uint8_t> k, std::span<const uint8_t> v,
                        std::span<const int32_t> slots) override {
    const absl::Status st = control_->Append({seq, layer, start, n, k, v, slots});
    data_->Appended(seq, layer, st.ok() ? start + n : KvDataPlane::kAppendFailed);
    return st;
  }

  // AppendAsync's rows straight into the staging file where the data plane has one (shm) and
  // they fit in what its earlier appends left free.
  StagedRows StageRows(std::span<const uint8_t> k, std::span<const uint8_t> v) override {
    if (k.size() != v.size()) return {};
    std::shared_ptr<StagingRing> ring = data_->append_staging();
    if (ring == nullptr) return {};
    std::optional<StagedRows> staged = ring->Reserve(k.size());
    if (!staged) return {};
    std::memcpy(staged->k().data(), k.data(), k.size());
    std::memcpy(staged->v().data(), v.data(), v.size());
    return *std::move(staged);
  }

  // One AppendBatch call for everything that piled up (an Append each costs a round trip): over
  // UCX in one message with its rows where the store takes that (the data plane's AppendBatch).
  // Over shm the rows of an append are in the staging file (StageRows), or copied there now if it
  // was full then and has room now; those staged in a file staging has moved on from are sent.
  std::vector<absl::Status> DoAppendBatch(const std::vector<AppendJob>& jobs) override {
    std::shared_ptr<StagingRing> ring = data_->append_staging();
    if (ring == nullptr) {  // over the data plane where it carries appends (UCX)
      std::vector<StoreAppend> appends;
      appends.reserve(jobs.size());
      for (const AppendJob& j : jobs) {
        appends.push_back({j.seq, j.layer, j.start, j.n, j.k_rows(), j.v_rows(), j.slots});
      }
      if (std::optional<std::vector<absl::Status>> statuses = data_->AppendBatch(appends)) {
        NoteAppended(jobs, *statuses);
        return *std::move(statuses);
      }
    }
    if (jobs.size() == 1 && ring == nullptr) {
      const AppendJob& j = jobs[0];
      return {DoAppend(j.seq, j.layer, j.start, j.n, j.k_rows(), j.v_rows(), j.slots)};
    }
    std::vector<StoreAppend> appends;
    appends.reserve(jobs.size());
    staged_now_.clear();  // given back when the call is done
    bool staged = false;
    for (const AppendJob& j : jobs) {
      StoreAppend a{j.seq, j.layer, j.start, j.n, j.k_rows(), j.v_rows(), j.slots};
      if (j.staged && j.staged.ring() == ring.get()) {
        a.staged_offset = j.staged.offset();
      } else if (ring != nullptr && !j.staged) {
        if (StagedRows now = StageRows(a.k, a.v)) {
          a.staged_offset = now.offset();
          staged_now_.push_back(std::move(now));
        }
      }
      staged |= a.staged_offset >= 0;
      appends.push_back(a);
    }
    absl::Status call;
    std::vector<absl::Status> statuses =
        control_->AppendBatch(appends, staged ? ring->file().path() : std::string(), &call,
                              staged ? data_->TakeReleasedStaging() : std::string());
    if (staged && call.ok()) {
      ring->file().Unlink();  // the store has it mapped
    } else if (staged) {
      // A call that failed may still be applied late, reading the file: the next goes to another
      // (none where the store refused the folder or the name).
      data_->RenewAppendStaging(/*stop=*/absl::IsInvalidArgument(call));
      if (absl::IsNotFound(call) || absl::IsInvalidArgument(call)) {
        // The store refused the file before applying anything (it no longer has it mapped, or
        // cannot open it): the rows go in the call instead, read from the file here.
        for (StoreAppend& a : appends) a.staged_offset = -1;
        statuses = control_->AppendBatch(appends);
      }
    }
    staged_now_.clear();
    NoteAppended(jobs, statuses);
    return statuses;
  }
  // Tells the data plane where each job's layer ends in the store now.
  void NoteAppended(const std::vector<AppendJob>& jobs, const std::vector<absl::Status>& statuses) {
    for (size_t i = 0; i < jobs.size(); ++i) {
      data_->Appended(jobs[i].seq, jobs[i].layer,
                      statuses[i].ok() ? jobs[i].start + jobs[i].n : KvDataPlane::kAppendFailed);
    }
  }

  absl::Status DoGather(const std::vector<ClientGatherItem>& items) override {
    return data_->Gather(items, specs_);
  }
  absl::StatusOr<KvStoreStats> DoStats() override { return control_->Stats(); }
  absl::Status DoRenew() override { return control_->Renew(config_.owner); }

 private:
  std::unique_ptr<KvControlPlane> control_;
  std::unique_ptr<KvDataPlane> data_;   // destroyed before the control plane it uses
  OpenSpecs specs_;                     // queue-thread state
  std::vector<StagedRows> staged_now_;  // append-thread state: DoAppendBatch's own staging
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
