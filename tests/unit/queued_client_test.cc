// The queue machinery every remote KV transport shares, against a fake transport: a batch's
// failed append fails the later appends of its sequence and no other; a gather sends the appends
// it waits for without those queued after; a Close that failed is
// retried before each lease renewal (the renewal would otherwise keep the sequence for the
// client's whole life), and so is a Release; an Open that went through after its caller gave up
// is closed.
#include "kv_store/client/queued_client.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace infinigen {
namespace {

class FakeTransport final : public QueuedKvClient {
 public:
  explicit FakeTransport(const KvClientConfig& config) : QueuedKvClient(config) { Start(); }
  ~FakeTransport() override { Stop(); }
  std::string transport() const override { return "fake"; }

  std::atomic<int> close_failures_left{0};
  std::atomic<int> closes{0}, renewals{0};
  std::atomic<int> release_failures_left{0};
  std::atomic<int> releases{0};
  std::atomic<int> open_delay_ms{0};
  absl::Mutex mu;
  std::vector<StoreSequenceId> closed ABSL_GUARDED_BY(mu);
  std::vector<StoreSequenceId> released ABSL_GUARDED_BY(mu);
  std::vector<std::pair<StoreSequenceId, int64_t>> applied ABSL_GUARDED_BY(mu);
  StoreSequenceId failing_seq = 0;

  using QueuedKvClient::AppendJob;
  // Records each batch's size (sent one by one, as the default does).
  std::vector<absl::Status> DoAppendBatch(const std::vector<AppendJob>& jobs) override {
    {
      absl::MutexLock lock(&mu);
      batches.push_back(jobs.size());
    }
    return QueuedKvClient::DoAppendBatch(jobs);
  }
  std::vector<size_t> batches ABSL_GUARDED_BY(mu);  // the appends of each batch sent, in order

 protected:
  absl::Status DoOpen(StoreSequenceId, const SequenceSpec&) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(open_delay_ms.load()));
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> DoAttach(StoreSequenceId, StoreSequenceId, const SequenceSpec&,
                                   int64_t) override {
    return absl::UnimplementedError("not used here");
  }
  absl::StatusOr<int64_t> DoFork(StoreSequenceId, StoreSequenceId, const SequenceSpec&,
                                 int64_t) override {
    return absl::UnimplementedError("not used here");
  }
  absl::Status DoClose(StoreSequenceId seq) override {
    ++closes;
    if (close_failures_left.load() > 0) {
      --close_failures_left;
      return absl::UnavailableError("store unreachable");
    }
    absl::MutexLock lock(&mu);
    closed.push_back(seq);
    return absl::OkStatus();
  }
  absl::Status DoRelease(StoreSequenceId seq) override {
    ++releases;
    if (release_failures_left.load() > 0) {
      --release_failures_left;
      return absl::UnavailableError("store unreachable");
    }
    absl::MutexLock lock(&mu);
    released.push_back(seq);
    return absl::OkStatus();
  }
  absl::Status DoAppend(StoreSequenceId seq, int, int64_t start, int64_t, std::span<const uint8_t>,
                        std::span<const uint8_t>, std::span<const int32_t>) override {
    if (seq == failing_seq) return absl::ResourceExhaustedError("store full");
    absl::MutexLock lock(&mu);
    applied.emplace_back(seq, start);
    return absl::OkStatus();
  }
  absl::Status DoGather(const std::vector<ClientGatherItem>&) override { return absl::OkStatus(); }
  absl::StatusOr<KvStoreStats> DoStats() override { return KvStoreStats{}; }
  absl::Status DoRenew() override {
    ++renewals;
    return absl::OkStatus();
  }
};

KvClientConfig Config(absl::Duration renew_every) {
  KvClientConfig c;
  c.renew_every = renew_every;
  c.call_timeout = absl::Milliseconds(50);
  c.append_linger = absl::ZeroDuration();
  return c;
}

TEST(QueuedClient, AFailedAppendFailsTheLaterAppendsOfItsSequenceOnly) {
  FakeTransport t(Config(absl::ZeroDuration()));
  t.failing_seq = 1;
  std::vector<FakeTransport::AppendJob> jobs;
  for (auto [seq, start] : {std::pair{1, 0}, std::pair{2, 0}, std::pair{1, 1}, std::pair{2, 1}}) {
    jobs.push_back({static_cast<StoreSequenceId>(seq), 0, start, 1, {}, {}, absl::Now(), {}, {}});
  }
  const std::vector<absl::Status> st = t.DoAppendBatch(jobs);
  ASSERT_EQ(st.size(), 4u);
  EXPECT_EQ(st[0].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(st[1].ok());
  EXPECT_EQ(st[2].code(), absl::StatusCode::kFailedPrecondition) << st[2];
  EXPECT_TRUE(st[3].ok());
  absl::MutexLock lock(&t.mu);
  EXPECT_EQ(t.applied, (std::vector<std::pair<StoreSequenceId, int64_t>>{{2, 0}, {2, 1}}));
}

// A gather waits for the appends to what it reads that were queued before it; those (and the
// ones before them) go as soon as it waits, without the appends queued after them, which would
// make it wait for their bytes too (a prompt chunk's megabytes behind a decode step's rows).
TEST(QueuedClient, AGatherWaitsOnlyForTheAppendsUpToItsOwn) {
  KvClientConfig c = Config(absl::ZeroDuration());
  c.append_linger = absl::Seconds(30);  // nothing goes for company
  FakeTransport t(c);
  const std::vector<uint8_t> row(64, 1), chunk(1 << 20, 2);
  t.AppendAsync(1, 0, 0, 1, row, row);         // a decode's row
  t.AppendAsync(1, 1, 0, 1, row, row);         // ... of the next layer
  t.AppendAsync(2, 0, 0, 1024, chunk, chunk);  // a prompt chunk's, after them
  ClientGatherItem item;
  item.seq = 1;
  item.layer = 0;
  ASSERT_TRUE(t.GatherAsync(std::span<const ClientGatherItem>(&item, 1))
                  ->Wait(absl::Now() + absl::Seconds(10))
                  .ok());
  {
    absl::MutexLock lock(&t.mu);
    EXPECT_EQ(t.batches, std::vector<size_t>{1}) << "the gather's append alone";
  }
  ASSERT_TRUE(t.Flush(absl::Now() + absl::Seconds(10)).ok());
  absl::MutexLock lock(&t.mu);
  EXPECT_EQ(t.batches, (std::vector<size_t>{1, 2})) << "then the rest, in order";
  EXPECT_EQ(t.applied, (std::vector<std::pair<StoreSequenceId, int64_t>>{{1, 0}, {1, 0}, {2, 0}}));
}

TEST(QueuedClient, AFailedCloseIsRetriedBeforeRenewals) {
  FakeTransport t(Config(absl::Milliseconds(10)));
  ASSERT_TRUE(t.Open(7, SequenceSpec{}).ok());
  t.close_failures_left = 2;
  EXPECT_EQ(t.Close(7).code(), absl::StatusCode::kUnavailable);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (;;) {
    {
      absl::MutexLock lock(&t.mu);
      // The retry that goes through is followed by its renewal, which may not have run yet.
      if ((!t.closed.empty() && t.renewals.load() >= 2) || absl::Now() > deadline) break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  absl::MutexLock lock(&t.mu);
  EXPECT_EQ(t.closed, std::vector<StoreSequenceId>{7});
  EXPECT_EQ(t.closes.load(), 3);  // the Close, a failed retry, the retry that went through
  EXPECT_GE(t.renewals.load(), 2);
}

// Likewise a Release (a failed stream's sequence left for the next worker): retried until it
// goes through, never turned into a Close.
TEST(QueuedClient, AFailedReleaseIsRetriedBeforeRenewals) {
  FakeTransport t(Config(absl::Milliseconds(10)));
  ASSERT_TRUE(t.Open(8, SequenceSpec{}).ok());
  t.release_failures_left = 2;
  EXPECT_EQ(t.Release(8).code(), absl::StatusCode::kUnavailable);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (;;) {
    {
      absl::MutexLock lock(&t.mu);
      if (!t.released.empty() || absl::Now() > deadline) break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  absl::MutexLock lock(&t.mu);
  EXPECT_EQ(t.released, std::vector<StoreSequenceId>{8});
  EXPECT_EQ(t.releases.load(), 3);  // the Release, a failed retry, the retry that went through
  EXPECT_TRUE(t.closed.empty());
}

TEST(QueuedClient, AnOpenItsCallerGaveUpOnIsClosed) {
  FakeTransport t(Config(absl::ZeroDuration()));
  t.open_delay_ms = 400;  // the Open's wait is 4 call timeouts: 200 ms
  EXPECT_EQ(t.Open(9, SequenceSpec{}).code(), absl::StatusCode::kDeadlineExceeded);
  t.open_delay_ms = 0;
  ASSERT_TRUE(t.Flush(absl::Now() + absl::Seconds(10)).ok());  // after the late Open's close
  absl::MutexLock lock(&t.mu);
  EXPECT_EQ(t.closed, std::vector<StoreSequenceId>{9});
}

}  // namespace
}  // namespace infinigen
