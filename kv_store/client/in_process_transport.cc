// The in-process transport: direct calls into a KvStore of this process (all-in-one server).
#include "absl/strings/str_cat.h"
#include "kv_store/client/queued_client.h"
#include "kv_store/client/transports.h"

namespace infinigen {
namespace {

class InProcessClient final : public QueuedKvClient {
 public:
  explicit InProcessClient(const KvClientConfig& config)
      : QueuedKvClient(config), store_(*config.store) {
    Start();
  }
  ~InProcessClient() override { Stop(); }
  std::string transport() const override { return "in-process"; }

 protected:
  absl::Status DoOpen(StoreSequenceId seq, const SequenceSpec& spec) override {
    return store_.Open(seq, spec, absl::Now());
  }
  absl::Status DoClose(StoreSequenceId seq) override { return store_.Close(seq); }
  absl::Status DoAppend(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                        const std::vector<uint8_t>& k, const std::vector<uint8_t>& v) override {
    if (k.size() != v.size()) return absl::InvalidArgumentError("k and v differ in size");
    return store_.Append(seq, layer, start, n, k.data(), v.data(), k.size());
  }
  absl::Status DoGather(const std::vector<ClientGatherItem>& items) override {
    std::vector<GatherItem> g;
    g.reserve(items.size());
    for (const auto& it : items) {
      g.push_back({it.seq, it.layer, it.count, it.slots, it.k_out, it.v_out});
    }
    return store_.Gather(g);
  }
  absl::StatusOr<KvStoreStats> DoStats() override { return store_.Stats(); }
  absl::Status DoRenew() override {
    store_.Renew(config_.owner, absl::Now());
    return absl::OkStatus();
  }

 private:
  KvStore& store_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeInProcessClient(const KvClientConfig& config) {
  if (config.store == nullptr) {
    return absl::InvalidArgumentError("the in-process transport needs a KvStore");
  }
  return std::unique_ptr<KvStoreClient>(new InProcessClient(config));
}

}  // namespace infinigen
