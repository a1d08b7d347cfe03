// The KV store as a real process: a killed store fails calls fast with UNAVAILABLE and a restarted
// one is reconnected to; a worker that stops renewing loses its sequences when the lease ends;
// a client abandoning a large gather mid-transfer harms nothing; SIGTERM drains and exits 0.
#include <gtest/gtest.h>

#include <thread>

#include "kv_store/client/kv_store_client.h"
#include "tests/support/process.h"

namespace infinigen {
namespace {

using testing::FreePort;
using testing::ServerProcess;

std::vector<std::string> StoreArgs(int port, int lease_s = 30) {
  return {"--listen=127.0.0.1:" + std::to_string(port), "--capacity_mb=64",
          "--lease_seconds=" + std::to_string(lease_s), "--huge_pages=false"};
}

std::unique_ptr<KvStoreClient> Client(int port, const std::string& owner,
                                      absl::Duration renew = absl::ZeroDuration()) {
  KvClientConfig c;
  c.transport = KvClientConfig::Transport::kGrpc;
  c.address = "127.0.0.1:" + std::to_string(port);
  c.owner = owner;
  c.call_timeout = absl::Seconds(1);
  c.renew_every = renew;
  return std::move(*MakeKvStoreClient(c));
}

SequenceSpec Spec() {
  SequenceSpec s;
  s.num_layers = 1;
  s.num_kv_heads = 2;
  s.head_dim = 64;
  s.dtype = DType::kF32;
  return s;
}

std::vector<uint8_t> Rows(int64_t n) { return std::vector<uint8_t>(n * 2 * 256, 7); }

absl::Status GatherOne(KvStoreClient& c, StoreSequenceId seq) {
  std::vector<uint8_t> k(512), v(512);
  auto t = c.GatherAsync({{seq, 0, 1, {0, 0}, k.data(), v.data()}});
  return t->Wait(absl::Now() + absl::Seconds(10));
}

TEST(KvStoreProcess, KilledStoreFailsFastAndRestartedStoreIsReconnected) {
  const int port = FreePort();
  auto store = std::make_unique<ServerProcess>("infinigen-kvstore", StoreArgs(port), port);
  ASSERT_TRUE(store->running());
  auto client = Client(port, "w1");
  ASSERT_TRUE(client->Open(1, Spec()).ok());
  client->AppendAsync(1, 0, 0, 4, Rows(4), Rows(4));
  ASSERT_TRUE(GatherOne(*client, 1).ok());

  store->Kill();
  const absl::Time t0 = absl::Now();
  const absl::Status down = GatherOne(*client, 1);
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(down.code(), absl::StatusCode::kUnavailable) << down;
  EXPECT_LT(took, absl::Seconds(2));

  store = std::make_unique<ServerProcess>("infinigen-kvstore", StoreArgs(port), port);
  ASSERT_TRUE(store->running());
  absl::Status reopened = absl::UnavailableError("not tried");
  for (int i = 0; i < 50 && !reopened.ok(); ++i) {
    reopened = client->Open(2, Spec());
    if (!reopened.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(reopened.ok()) << reopened;
  // The old store's sequences died with it.
  EXPECT_EQ(GatherOne(*client, 1).code(), absl::StatusCode::kNotFound);
}

TEST(KvStoreProcess, SequencesOfAWorkerThatStopsRenewingAreFreed) {
  const int port = FreePort();
  ServerProcess store("infinigen-kvstore", StoreArgs(port, /*lease_s=*/1), port);
  ASSERT_TRUE(store.running());
  auto alive = Client(port, "alive", absl::Milliseconds(200));
  ASSERT_TRUE(alive->Open(10, Spec()).ok());
  {
    auto dead = Client(port, "dead");  // never renews, then goes away
    ASSERT_TRUE(dead->Open(11, Spec()).ok());
    dead->AppendAsync(11, 0, 0, 8, Rows(8), Rows(8));
    ASSERT_TRUE(dead->Flush(absl::Now() + absl::Seconds(5)).ok());
  }
  auto observer = Client(port, "observer");
  int64_t sequences = -1;
  for (int i = 0; i < 40; ++i) {
    sequences = observer->Stats()->sequences;
    if (sequences == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(sequences, 1);  // the renewing worker's sequence stays
  EXPECT_EQ(observer->Stats()->leases_expired, 1);
  EXPECT_TRUE(GatherOne(*alive, 10).code() != absl::StatusCode::kNotFound);
}

TEST(KvStoreProcess, AbandonedTransfersDoNotHurtTheStore) {
  const int port = FreePort();
  ServerProcess store("infinigen-kvstore", StoreArgs(port), port);
  ASSERT_TRUE(store.running());
  {
    KvClientConfig c;
    c.transport = KvClientConfig::Transport::kGrpc;
    c.address = "127.0.0.1:" + std::to_string(port);
    c.call_timeout = absl::Milliseconds(1);  // every large call is cut off mid-flight
    c.renew_every = absl::ZeroDuration();
    auto impatient = std::move(*MakeKvStoreClient(c));
    auto patient = Client(port, "patient");
    ASSERT_TRUE(patient->Open(5, Spec()).ok());
    patient->AppendAsync(5, 0, 0, 4096, Rows(4096), Rows(4096));
    ASSERT_TRUE(patient->Flush(absl::Now() + absl::Seconds(10)).ok());
    std::vector<int32_t> slots(2 * 4096);
    for (int i = 0; i < 8192; ++i) slots[i] = i % 4096;
    std::vector<uint8_t> k(slots.size() * 256), v(k.size());
    for (int i = 0; i < 20; ++i) {
      auto t = impatient->GatherAsync({{5, 0, 4096, slots, k.data(), v.data()}});
      EXPECT_FALSE(t->Wait(absl::Now() + absl::Seconds(5)).ok());
    }
  }
  auto client = Client(port, "after");
  auto stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->sequences, 1);
}

TEST(KvStoreProcess, SigtermDrainsAndExitsCleanly) {
  const int port = FreePort();
  ServerProcess store("infinigen-kvstore", StoreArgs(port), port);
  ASSERT_TRUE(store.running());
  EXPECT_EQ(store.Terminate(10), 0);
}

}  // namespace
}  // namespace infinigen
