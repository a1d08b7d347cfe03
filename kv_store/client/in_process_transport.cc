// The in-process transport: direct calls into a KvStore of this process (all-in-one server).
// Every call runs on the caller's thread: an append or a gather here is a copy of a few hundred
// kilobytes at most, cheaper than handing it to another thread and waking the caller again
// (measured: docs/benchmarks.md, "Worker"). Calls are therefore in order by construction, and a
// gather's ticket is done when GatherAsync returns.
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "kv_store/client/append_failures.h"
#include "kv_store/client/transports.h"

namespace infinigen {
namespace {

class InProcessClient final : public KvStoreClient {
 public:
  explicit InProcessClient(const KvClientConfig& config) : config_(config), store_(*config.store) {
    if (config_.renew_every > absl::ZeroDuration()) {
      renew_thread_ = std::thread([this] {
        while (!stop_.WaitForNotificationWithTimeout(config_.renew_every)) {
          store_.Renew(config_.owner, absl::Now());
        }
      });
    }
  }
  ~InProcessClient() override {
    stop_.Notify();
    if (renew_thread_.joinable()) renew_thread_.join();
  }
  std::string transport() const override { return "in-process"; }

  absl::Status Open(StoreSequenceId seq, const SequenceSpec& spec) override {
    SequenceSpec s = spec;
    if (s.owner.empty()) s.owner = config_.owner;
    absl::Status st = store_.Open(seq, s, absl::Now());
    if (st.ok()) append_failures_.Forget(seq);
    return st;
  }
  absl::StatusOr<int64_t> Attach(StoreSequenceId from, StoreSequenceId to, const SequenceSpec& spec,
                                 int64_t max_length) override {
    return Transfer(from, to, spec, max_length, /*fork=*/false);
  }
  absl::StatusOr<int64_t> Fork(StoreSequenceId from, StoreSequenceId to, const SequenceSpec& spec,
                               int64_t length) override {
    return Transfer(from, to, spec, length, /*fork=*/true);
  }
  absl::Status Close(StoreSequenceId seq) override {
    append_failures_.Forget(seq);
    return store_.Close(seq);
  }
  absl::Status Release(StoreSequenceId seq) override {
    append_failures_.Forget(seq);
    return store_.Release(seq, absl::Now());
  }
  using KvStoreClient::AppendAsync;
  void AppendAsync(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                   std::span<const uint8_t> k, std::span<const uint8_t> v,
                   std::span<const int32_t> slots) override {
    absl::Status st = k.size() == v.size() ? store_.Append(seq, layer, start, n, k.data(), v.data(),
                                                           k.size(), nullptr, slots)
                                           : absl::InvalidArgumentError("k and v differ in size");
    if (st.ok()) return;
    append_failures_.Record(seq, layer, st);
    absl::MutexLock lock(&mu_);
    if (append_error_.ok()) append_error_ = st;
  }
  absl::Status Flush(absl::Time) override {
    absl::MutexLock lock(&mu_);
    absl::Status error = append_error_;
    append_error_ = absl::OkStatus();
    return error;
  }
  std::shared_ptr<GatherTicket> GatherAsync(std::span<const ClientGatherItem> items) override {
    // The store's items in this thread's scratch (capacity kept: a decode step's gathers
    // allocate nothing), and one shared ticket for every gather that succeeded.
    thread_local std::vector<GatherItem> g;
    g.clear();
    for (const auto& it : items) {
      g.push_back({it.seq, it.layer, it.count, it.slots, it.k_out, it.v_out, /*head_begin=*/0,
                   /*heads=*/-1, it.k_rows, it.v_rows, /*row_bytes=*/0, it.block_table});
    }
    absl::Status st = store_.Gather(g);
    if (st.ok()) {
      static const std::shared_ptr<GatherTicket> done =
          std::make_shared<DoneTicket>(absl::OkStatus());
      return done;
    }
    return std::make_shared<DoneTicket>(append_failures_.Explain(st, items));
  }
  bool reads_in_place() const override { return true; }
  Span mapped_memory() const override {
    const Arena& a = store_.arena();
    return {a.base(), static_cast<size_t>(a.num_blocks()) * a.block_bytes(), a.block_bytes(),
            /*generation=*/0};
  }
  absl::StatusOr<KvStoreStats> Stats() override { return store_.Stats(); }

 private:
  // Attach, or with `fork` Fork: `to` becomes this client's sequence.
  absl::StatusOr<int64_t> Transfer(StoreSequenceId from, StoreSequenceId to,
                                   const SequenceSpec& spec, int64_t length, bool fork) {
    SequenceSpec s = spec;
    if (s.owner.empty()) s.owner = config_.owner;
    auto kept = fork ? store_.Fork(from, to, s, length, absl::Now())
                     : store_.Attach(from, to, s, length, absl::Now());
    if (kept.ok()) append_failures_.Forget(to);
    return kept;
  }

  const KvClientConfig config_;
  KvStore& store_;
  absl::Mutex mu_;
  absl::Status append_error_ ABSL_GUARDED_BY(mu_);  // the first since the last Flush
  AppendFailures append_failures_;
  absl::Notification stop_;
  std::thread renew_thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeInProcessClient(const KvClientConfig& config) {
  if (config.store == nullptr) {
    return absl::InvalidArgumentError("the in-process transport needs a KvStore");
  }
  return std::unique_ptr<KvStoreClient>(new InProcessClient(config));
}

}  // namespace infinigen
