// The KV store as a real process: a killed store fails calls fast with UNAVAILABLE and a restarted
// one is reconnected to; a worker that stops renewing loses its sequences when the lease ends;
// a client abandoning a large gather mid-transfer harms nothing; SIGTERM drains and exits 0.
// Fault tests run over the gRPC and shm data paths and, where built, the UCX one.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kv_store/client/kv_store_client.h"
#include "tests/support/health_check.h"
#include "tests/support/process.h"

namespace infinigen {
namespace {

using testing::FreePort;
using testing::ServerProcess;

using Transport = KvClientConfig::Transport;

// ucx_port 0: no UCX data plane.
std::vector<std::string> StoreArgs(int port, int lease_s = 30, int ucx_port = 0) {
  setenv("UCX_NET_DEVICES", "lo", 0);  // loopback only, as a test must (inherited by the store)
  return {"--listen=127.0.0.1:" + std::to_string(port), "--capacity_mb=64",
          "--lease_seconds=" + std::to_string(lease_s), "--huge_pages=false",
          "--ucx_port=" + std::to_string(ucx_port)};
}

std::unique_ptr<KvStoreClient> Client(int port, const std::string& owner,
                                      absl::Duration renew = absl::ZeroDuration(),
                                      Transport transport = Transport::kGrpc,
                                      absl::Duration timeout = absl::Seconds(1)) {
  KvClientConfig c;
  c.transport = transport;
  c.address = "127.0.0.1:" + std::to_string(port);
  c.owner = owner;
  c.call_timeout = timeout;
  c.renew_every = renew;
  auto client = MakeKvStoreClient(c);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

class KvStoreFaults : public ::testing::TestWithParam<Transport> {
 protected:
  // The store's arguments for this transport (a UCX port when the data plane is UCX).
  std::vector<std::string> Args(int port) {
    if (ucx_port_ == 0 && GetParam() == Transport::kUcx) ucx_port_ = FreePort();
    return StoreArgs(port, 30, ucx_port_);
  }
  int ucx_port_ = 0;
};

SequenceSpec Spec() {
  SequenceSpec s;
  s.num_layers = 1;
  s.num_kv_heads = 2;
  s.head_dim = 64;
  s.dtype = DType::kF32;
  return s;
}

std::vector<uint8_t> Rows(int64_t n, uint8_t fill = 7) {
  return std::vector<uint8_t>(n * 2 * 256, fill);
}

// Gathers row 0 of both heads of layer 0; `fill`: every byte must be this.
absl::Status GatherOne(KvStoreClient& c, StoreSequenceId seq, int fill = -1) {
  std::vector<uint8_t> k(512), v(512);
  auto t = c.GatherAsync({{seq, 0, 1, {0, 0}, k.data(), v.data()}});
  absl::Status st = t->Wait(absl::Now() + absl::Seconds(10));
  if (st.ok() && fill >= 0) {
    for (size_t i = 0; i < k.size(); ++i) {
      if (k[i] != fill || v[i] != fill) {
        return absl::DataLossError(absl::StrCat("byte ", i, " of the gathered rows is ", int{k[i]},
                                                "/", int{v[i]}, ", not ", fill));
      }
    }
  }
  return st;
}

TEST_P(KvStoreFaults, KilledStoreFailsFastAndRestartedStoreIsReconnected) {
  const int port = FreePort();
  auto store = std::make_unique<ServerProcess>("infinigen-kvstore", Args(port), port);
  ASSERT_TRUE(store->running());
  auto client = Client(port, "w1", absl::ZeroDuration(), GetParam());
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Open(1, Spec()).ok());
  client->AppendAsync(1, 0, 0, 4, Rows(4), Rows(4));
  ASSERT_TRUE(GatherOne(*client, 1, 7).ok());

  store->Kill();
  const absl::Time t0 = absl::Now();
  // The next row cannot be stored, so its gather fails (shm included, which would otherwise
  // read rows stored before from the mapping).
  client->AppendAsync(1, 0, 4, 1, Rows(1), Rows(1));
  std::vector<uint8_t> k(512), v(512);
  const absl::Status down = client->GatherAsync({{1, 0, 1, {4, 4}, k.data(), v.data()}})
                                ->Wait(absl::Now() + absl::Seconds(10));
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(down.code(), absl::StatusCode::kUnavailable) << down;
  EXPECT_LT(took, absl::Seconds(2));
  // Rows stored before the store died are not read from the mapping either: after a failed
  // append the shm client asks the store first.
  const absl::Status old_rows = client->GatherAsync({{1, 0, 1, {0, 0}, k.data(), v.data()}})
                                    ->Wait(absl::Now() + absl::Seconds(10));
  EXPECT_EQ(old_rows.code(), absl::StatusCode::kUnavailable) << old_rows;

  store = std::make_unique<ServerProcess>("infinigen-kvstore", Args(port), port);
  ASSERT_TRUE(store->running());
  absl::Status reopened = absl::UnavailableError("not tried");
  const absl::Time up = absl::Now();
  for (int i = 0; i < 50 && !reopened.ok(); ++i) {
    reopened = client->Open(2, Spec());
    if (!reopened.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(reopened.ok()) << reopened;
  // Promptly, although calls failed while it was down (gRPC's backup poller alone took 5 s).
  EXPECT_LT(absl::Now() - up, absl::Seconds(2));
  // The old store's sequences died with it; the new one serves the data path again, with the
  // new store's bytes (shm: its arena is a new segment, mapped anew).
  EXPECT_EQ(GatherOne(*client, 1).code(), absl::StatusCode::kNotFound);
  client->AppendAsync(2, 0, 0, 4, Rows(4, 9), Rows(4, 9));
  const absl::Status again = GatherOne(*client, 2, 9);
  EXPECT_TRUE(again.ok()) << again;
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

TEST_P(KvStoreFaults, AbandonedTransfersDoNotHurtTheStore) {
  if (GetParam() == Transport::kShm) GTEST_SKIP() << "shm gathers are local copies: no transfer";
  const int port = FreePort();
  ServerProcess store("infinigen-kvstore", Args(port), port);
  ASSERT_TRUE(store.running());
  auto patient = Client(port, "patient", absl::ZeroDuration(), GetParam());
  ASSERT_NE(patient, nullptr);
  ASSERT_TRUE(patient->Open(5, Spec()).ok());
  std::vector<uint8_t> rows(4096 * 2 * 256);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<uint8_t>(i * 7 + i / 256);
  patient->AppendAsync(5, 0, 0, 4096, rows, rows);
  ASSERT_TRUE(patient->Flush(absl::Now() + absl::Seconds(10)).ok());
  std::vector<int32_t> slots(2 * 4096);
  for (int i = 0; i < 8192; ++i) slots[i] = i % 4096;
  {
    // Every large call is cut off mid-flight (4 MiB per gather, 1 ms to do it).
    auto impatient =
        Client(port, "impatient", absl::ZeroDuration(), GetParam(), absl::Milliseconds(1));
    ASSERT_NE(impatient, nullptr);
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
  // The patient client still gets every byte right over the same data path.
  std::vector<uint8_t> k(slots.size() * 256), v(k.size());
  auto t = patient->GatherAsync({{5, 0, 4096, slots, k.data(), v.data()}});
  ASSERT_TRUE(t->Wait(absl::Now() + absl::Seconds(10)).ok());
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < 4096; ++r) {
      const uint8_t* want = rows.data() + (static_cast<size_t>(r) * 2 + h) * 256;
      ASSERT_EQ(std::memcmp(k.data() + (static_cast<size_t>(h) * 4096 + r) * 256, want, 256), 0)
          << "head " << h << " row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DataPaths, KvStoreFaults,
                         ::testing::Values(Transport::kGrpc, Transport::kShm
#if INFINIGEN_HAVE_UCX
                                           ,
                                           Transport::kUcx
#endif
                                           ),
                         [](const auto& info) {
                           return std::string(info.param == Transport::kUcx   ? "Ucx"
                                              : info.param == Transport::kShm ? "Shm"
                                                                              : "Grpc");
                         });

// grpc.health.v1 answers for the whole server and for the store's service by name (what
// `grpc-health-probe -service` and Kubernetes' gRPC probes with `service:` ask); other names
// are NOT_FOUND.
TEST(KvStoreProcess, HealthAnswersByServiceName) {
  const int port = FreePort();
  ServerProcess store("infinigen-kvstore", StoreArgs(port), port);
  ASSERT_TRUE(store.running());
  testing::ExpectHealthByServiceName("127.0.0.1:" + std::to_string(port),
                                     "infinigen.kvstore.v1.KvStore");
}

TEST(KvStoreProcess, SigtermDrainsAndExitsCleanly) {
  const int port = FreePort();
  ServerProcess store("infinigen-kvstore", StoreArgs(port), port);
  ASSERT_TRUE(store.running());
  EXPECT_EQ(store.Terminate(10), 0);
}

}  // namespace
}  // namespace infinigen
