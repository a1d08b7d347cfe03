// One test suite for every KV transport: in-process, gRPC, shm and UCX. The remote ones talk to a
// real gRPC server on 127.0.0.1 serving a real store (UCX over loopback). Then the service's
// limits. The UCX data plane against peers that misbehave or leave: ucx_data_plane_test.cc.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/service/kvstore_service.h"
#include "kv_store/staging_file.h"
#if INFINIGEN_HAVE_UCX
#include "kv_store/ucx/ucx_data_plane.h"
#endif

namespace infinigen {
namespace {

class KvTransport : public ::testing::TestWithParam<KvClientConfig::Transport> {
 protected:
  void SetUp() override {
    KvStoreConfig c;
    c.capacity_bytes = 4 << 20;
    c.block_tokens = 16;
    c.max_row_bytes = 256;
    c.huge_pages = false;
    store_ = std::move(*KvStore::Create(c));
    KvClientConfig cc;
    cc.transport = GetParam();
    cc.owner = "test-worker";
    cc.renew_every = absl::ZeroDuration();
    if (GetParam() == KvClientConfig::Transport::kInProcess) {
      cc.store = store_.get();
    } else {
      service_ = std::make_unique<KvStoreService>(*store_);
#if INFINIGEN_HAVE_UCX
      if (GetParam() == KvClientConfig::Transport::kUcx) {
        setenv("UCX_NET_DEVICES", "lo", 0);  // loopback only, as a test must
        auto ucx = UcxDataServer::Start(
            *store_, 0, [this](std::span<const uint8_t> request, std::span<const uint8_t> rows) {
              return service_->AppendBatchWithRows(request, rows);
            });
        ASSERT_TRUE(ucx.ok()) << ucx.status();
        ucx_ = std::move(*ucx);
        service_->set_ucx_port(ucx_->port(), /*appends=*/true);
      }
#endif
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      builder.SetMaxReceiveMessageSize(64 << 20);
      builder.RegisterService(service_.get());
      server_ = builder.BuildAndStart();
      ASSERT_NE(port, 0);
      cc.address = "127.0.0.1:" + std::to_string(port);
    }
    config_ = cc;
    auto client = MakeKvStoreClient(cc);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  // Replaces the client by one whose appends linger up to `linger`.
  void Reconnect(absl::Duration linger) {
    client_.reset();
    config_.append_linger = linger;
    auto client = MakeKvStoreClient(config_);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  void TearDown() override {
    client_.reset();
    if (server_) server_->Shutdown();
#if INFINIGEN_HAVE_UCX
    ucx_.reset();
#endif
  }

  static SequenceSpec Spec() {
    SequenceSpec s;
    s.num_layers = 2;
    s.num_kv_heads = 2;
    s.head_dim = 16;
    s.dtype = DType::kBF16;
    return s;
  }
  // Row bytes of token t, all heads.
  static std::vector<uint8_t> TokenRows(int64_t t, int64_t n, uint8_t kv) {
    const int64_t bytes = 2 * 32;
    std::vector<uint8_t> out(n * bytes);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t b = 0; b < bytes; ++b)
        out[i * bytes + b] = static_cast<uint8_t>((t + i) * 3 + b + kv * 101);
    }
    return out;
  }

  std::unique_ptr<KvStore> store_;
  std::unique_ptr<KvStoreService> service_;
  std::unique_ptr<grpc::Server> server_;
#if INFINIGEN_HAVE_UCX
  std::unique_ptr<UcxDataServer> ucx_;
#endif
  KvClientConfig config_;
  std::unique_ptr<KvStoreClient> client_;

  // This process's staging files in /dev/shm (the shm client's, kv_store/staging_file.h).
  static std::vector<std::filesystem::path> StagingFiles() {
    const std::string prefix = absl::StrCat(kStagingFilePrefix, ::getpid(), "-");
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
      if (absl::StartsWith(e.path().filename().string(), prefix)) files.push_back(e.path());
    }
    return files;
  }
  // Opens `seq`, appends 40 tokens to layer 0 and reads two rows back.
  void AppendThenRead(StoreSequenceId seq) {
    ASSERT_TRUE(client_->Open(seq, Spec()).ok());
    client_->AppendAsync(seq, 0, 0, 40, TokenRows(0, 40, 0), TokenRows(0, 40, 1));
    ASSERT_TRUE(client_->Flush(Soon()).ok());
    std::vector<int32_t> slots = {39, 0};  // [2 heads, 1]
    std::vector<uint8_t> k(2 * 32), v(2 * 32);
    ASSERT_TRUE(client_->GatherAsync({{seq, 0, 1, slots, k.data(), v.data()}})->Wait(Soon()).ok());
    EXPECT_EQ(0, std::memcmp(k.data(), TokenRows(39, 1, 0).data(), 32));
    EXPECT_EQ(0, std::memcmp(v.data() + 32, TokenRows(0, 1, 1).data() + 32, 32));
  }
  static absl::Time Soon() { return absl::Now() + absl::Seconds(5); }

  // Two sequences of 5000 tokens, then one gather of 12 items of 0 to 4000 rows per head; every
  // row byte checked.
  void GatherLargeSmallAndEmptyItems();
};

TEST_P(KvTransport, AppendThenGatherReturnsTheRows) {
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  client_->AppendAsync(1, 1, 0, 40, TokenRows(0, 40, 0), TokenRows(0, 40, 1));
  for (int64_t t = 40; t < 50; ++t)
    client_->AppendAsync(1, 1, t, 1, TokenRows(t, 1, 0), TokenRows(t, 1, 1));
  std::vector<int32_t> slots = {0, 49, 17, 3, 44, 44};  // [2 heads, 3]
  std::vector<uint8_t> k(6 * 32), v(6 * 32);
  auto ticket = client_->GatherAsync({{1, 1, 3, slots, k.data(), v.data()}});
  ASSERT_TRUE(ticket->Wait(Soon()).ok());
  for (int g = 0; g < 2; ++g) {
    for (int j = 0; j < 3; ++j) {
      const int32_t t = slots[g * 3 + j];
      const auto want_k = TokenRows(t, 1, 0), want_v = TokenRows(t, 1, 1);
      EXPECT_EQ(0, std::memcmp(k.data() + (g * 3 + j) * 32, want_k.data() + g * 32, 32)) << t;
      EXPECT_EQ(0, std::memcmp(v.data() + (g * 3 + j) * 32, want_v.data() + g * 32, 32)) << t;
    }
  }
  EXPECT_TRUE(client_->Flush(Soon()).ok());
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sequences, 1);
  // The shm transport copies rows itself: no gather reaches the store (no RPC on the data path).
  EXPECT_EQ(stats->gathers, GetParam() == KvClientConfig::Transport::kShm ? 0 : 1);
  EXPECT_TRUE(client_->Close(1).ok());
}

// Over shm the appends' rows go through a staging file of the client's beside the store's arena
// (the store copies them from it). Its name is removed once the store has mapped it (nothing is
// left behind if the client dies); a store that cannot open it (here: removed before its first
// use) refuses it, and the rows go in the call instead, the next batch through a new file. The
// rows read back are the ones appended.
TEST_P(KvTransport, ShmAppendsAreStagedInAFileThatNeverOutlivesItsUse) {
  if (GetParam() != KvClientConfig::Transport::kShm) GTEST_SKIP() << "shm only";
  ASSERT_EQ(StagingFiles().size(), 1u) << "this test's client's, not used yet";
  AppendThenRead(1);
  EXPECT_TRUE(StagingFiles().empty()) << "unlinked once the store mapped it";
  // A new client whose file the store cannot open.
  Reconnect(config_.append_linger);
  const std::vector<std::filesystem::path> files = StagingFiles();
  ASSERT_EQ(files.size(), 1u);
  std::filesystem::remove(files[0]);
  AppendThenRead(2);
  EXPECT_EQ(StagingFiles().size(), 1u) << "the next batch's file";
  AppendThenRead(3);
  EXPECT_TRUE(StagingFiles().empty());
}

// Over shm AppendAsync writes the rows straight into the staging file (before any call: the
// linger holds them), K then V; an append that does not fit beside those still queued goes
// through the queue and is staged when its batch leaves, and the ring's space is reused once the
// store has read it. Every row read back is the one appended, from two threads at once.
TEST_P(KvTransport, ShmAppendsAreWrittenIntoTheStagingFileAsTheyAreQueued) {
  if (GetParam() != KvClientConfig::Transport::kShm) GTEST_SKIP() << "shm only";
  config_.append_staging_bytes = 8 << 10;
  Reconnect(absl::Minutes(1));
  const std::vector<std::filesystem::path> files = StagingFiles();
  ASSERT_EQ(files.size(), 1u);
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  const std::vector<uint8_t> k = TokenRows(0, 40, 0), v = TokenRows(0, 40, 1);  // 2560 B each
  client_->AppendAsync(1, 0, 0, 40, k, v);
  client_->AppendAsync(1, 0, 40, 40, TokenRows(40, 40, 0), TokenRows(40, 40, 1));  // no room
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(store_->Stats().appends, 0) << "queued appends linger";
  {
    std::ifstream in(files[0], std::ios::binary);
    std::vector<uint8_t> file(2 * k.size());
    in.read(reinterpret_cast<char*>(file.data()), static_cast<std::streamsize>(file.size()));
    ASSERT_TRUE(in.good());
    EXPECT_TRUE(std::equal(k.begin(), k.end(), file.begin())) << "K staged at AppendAsync";
    EXPECT_TRUE(std::equal(v.begin(), v.end(), file.begin() + k.size())) << "then V";
  }
  ASSERT_TRUE(client_->Flush(Soon()).ok());
  std::vector<int32_t> first = {0, 79};  // head 0: token 0; head 1: token 79 (not staged)
  std::vector<uint8_t> fk(2 * 32), fv(2 * 32);
  ASSERT_TRUE(client_->GatherAsync({{1, 0, 1, first, fk.data(), fv.data()}})->Wait(Soon()).ok());
  EXPECT_EQ(0, std::memcmp(fk.data(), TokenRows(0, 1, 0).data(), 32));
  EXPECT_EQ(0, std::memcmp(fv.data() + 32, TokenRows(79, 1, 1).data() + 32, 32));

  // Two threads, a sequence each, appends of 1-24 tokens in batches of a millisecond's: the
  // ring fills, wraps and empties.
  Reconnect(absl::Milliseconds(1));
  std::vector<std::thread> threads;
  constexpr int64_t kTokens = 1200;
  for (StoreSequenceId seq : {StoreSequenceId{3}, StoreSequenceId{4}}) {
    ASSERT_TRUE(client_->Open(seq, Spec()).ok());
    threads.emplace_back([this, seq] {
      for (int64_t t = 0, n = 1; t < kTokens; t += n, n = std::min(n % 24 + 1, kTokens - t)) {
        client_->AppendAsync(seq, 1, t, n, TokenRows(t, n, 0), TokenRows(t, n, 1));
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(client_->Flush(Soon()).ok());
  std::vector<int32_t> slots;
  for (int g = 0; g < 2; ++g) {
    for (int64_t t = 0; t < kTokens; ++t) slots.push_back(static_cast<int32_t>(t));
  }
  const std::vector<uint8_t> want_k = TokenRows(0, kTokens, 0), want_v = TokenRows(0, kTokens, 1);
  for (StoreSequenceId seq : {StoreSequenceId{3}, StoreSequenceId{4}}) {
    std::vector<uint8_t> gk(2 * kTokens * 32), gv(2 * kTokens * 32);
    ASSERT_TRUE(
        client_->GatherAsync({{seq, 1, kTokens, slots, gk.data(), gv.data()}})->Wait(Soon()).ok());
    for (int g = 0; g < 2; ++g) {
      for (int64_t t = 0; t < kTokens; ++t) {
        ASSERT_EQ(
            0, std::memcmp(gk.data() + (g * kTokens + t) * 32, want_k.data() + t * 64 + g * 32, 32))
            << seq << " " << t;
        ASSERT_EQ(
            0, std::memcmp(gv.data() + (g * kTokens + t) * 32, want_v.data() + t * 64 + g * 32, 32))
            << seq << " " << t;
      }
    }
  }
}

// A store restarted with its arena in another folder refuses the client's staging file (not in
// the folder it takes them from: INVALID_ARGUMENT); the client sends that batch's rows in the
// call and stages no more (no new file is made, so none is refused again).
TEST_P(KvTransport, ShmStagingStopsWhenARestartedStoreRefusesItsFolder) {
  if (GetParam() != KvClientConfig::Transport::kShm) GTEST_SKIP() << "shm only";
  AppendThenRead(1);
  ASSERT_TRUE(StagingFiles().empty()) << "staged, then unlinked once the store mapped it";
  const std::string port = config_.address.substr(config_.address.rfind(':') + 1);
  char dir_template[] = "/tmp/infinigen-arena-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  {  // The store restarts on the same port, its arena a file in `dir`.
    server_->Shutdown();
    server_.reset();
    service_.reset();
    KvStoreConfig c;
    c.capacity_bytes = 4 << 20;
    c.block_tokens = 16;
    c.max_row_bytes = 256;
    c.huge_pages = false;
    c.shm_path = dir + "/arena";
    auto store = KvStore::Create(c);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    service_ = std::make_unique<KvStoreService>(*store_);
    grpc::ServerBuilder builder;
    int bound = 0;
    builder.AddListeningPort("127.0.0.1:" + port, grpc::InsecureServerCredentials(), &bound);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_EQ(std::to_string(bound), port);
  }
  AppendThenRead(2);  // the file refused: its rows went in the call
  EXPECT_TRUE(StagingFiles().empty()) << "no new staging file after the store refused the folder";
  AppendThenRead(3);
  EXPECT_TRUE(StagingFiles().empty());
  int in_dir = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    in_dir += absl::StartsWith(e.path().filename().string(), kStagingFilePrefix);
  }
  EXPECT_EQ(in_dir, 0) << "the client kept the folder it started with, then none";
  client_.reset();
  server_->Shutdown();
  server_.reset();
  service_.reset();
  store_.reset();
  std::filesystem::remove_all(dir);
}

// A KV pool sequence's rows go to the slots the client (the worker) chose, over every
// transport; a slot the store cannot take fails the append, which the next Flush reports.
TEST_P(KvTransport, PooledAppendsLandInTheSlotsGiven) {
  SequenceSpec spec = Spec();
  spec.capacity_tokens = 4;
  ASSERT_TRUE(client_->Open(1, spec).ok());
  client_->AppendAsync(1, 0, 0, 4, TokenRows(0, 4, 0), TokenRows(0, 4, 1));
  client_->AppendAsync(1, 0, 4, 1, TokenRows(4, 1, 0), TokenRows(4, 1, 1),
                       std::vector<int32_t>{1, 3});
  client_->AppendAsync(1, 0, 5, 1, TokenRows(5, 1, 0), TokenRows(5, 1, 1),
                       std::vector<int32_t>{0, 1});
  ASSERT_TRUE(client_->Flush(Soon()).ok());
  const std::vector<int32_t> slots = {0, 1, 2, 3, 0, 1, 2, 3};
  const std::vector<int32_t> tokens = {5, 4, 2, 3, 0, 5, 2, 4};  // [head][slot]
  std::vector<uint8_t> k(8 * 32), v(8 * 32);
  auto ticket = client_->GatherAsync({{1, 0, 4, slots, k.data(), v.data()}});
  ASSERT_TRUE(ticket->Wait(Soon()).ok());
  for (int g = 0; g < 2; ++g) {
    for (int j = 0; j < 4; ++j) {
      const int32_t t = tokens[g * 4 + j];
      const auto want_k = TokenRows(t, 1, 0), want_v = TokenRows(t, 1, 1);
      EXPECT_EQ(0, std::memcmp(k.data() + (g * 4 + j) * 32, want_k.data() + g * 32, 32)) << t;
      EXPECT_EQ(0, std::memcmp(v.data() + (g * 4 + j) * 32, want_v.data() + g * 32, 32)) << t;
    }
  }
  client_->AppendAsync(1, 0, 6, 1, TokenRows(6, 1, 0), TokenRows(6, 1, 1),
                       std::vector<int32_t>{4, 0});
  const absl::Status st = client_->Flush(Soon());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(client_->Close(1).ok());
}

// Attach over every transport: another client (another worker) takes a sequence over under its
// own id and gathers the rows the first one appended (shm: through its own block tables); the
// first client's late appends to the old id fail, and the old id cannot be attached twice.
TEST_P(KvTransport, AttachHandsTheRowsToAnotherClient) {
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  for (int layer = 0; layer < 2; ++layer) {
    client_->AppendAsync(1, layer, 0, 30, TokenRows(0, 30, 0), TokenRows(0, 30, 1));
  }
  ASSERT_TRUE(client_->Flush(Soon()).ok());
  KvClientConfig other = config_;
  other.owner = "test-worker-2";
  auto b = MakeKvStoreClient(other);
  ASSERT_TRUE(b.ok()) << b.status();
  auto kept = (*b)->Attach(1, 2, Spec(), /*max_length=*/29);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, 29);
  std::vector<int32_t> slots = {28, 0, 5, 28};  // [2 heads, 2]
  std::vector<uint8_t> k(4 * 32), v(4 * 32);
  auto ticket = (*b)->GatherAsync({{2, 1, 2, slots, k.data(), v.data()}});
  ASSERT_TRUE(ticket->Wait(Soon()).ok());
  for (int i = 0; i < 4; ++i) {
    const auto want_k = TokenRows(slots[i], 1, 0);
    EXPECT_EQ(0, std::memcmp(k.data() + i * 32, want_k.data() + (i / 2) * 32, 32)) << i;
  }
  (*b)->AppendAsync(2, 0, 29, 1, TokenRows(29, 1, 0), TokenRows(29, 1, 1));
  EXPECT_TRUE((*b)->Flush(Soon()).ok());
  client_->AppendAsync(1, 1, 30, 1, TokenRows(30, 1, 0), TokenRows(30, 1, 1));
  EXPECT_EQ(client_->Flush(Soon()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*b)->Attach(1, 3, Spec(), 29).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE((*b)->Close(2).ok());
}

// Fork over every transport: a copy of a sequence after the appends queued before it, gathered
// as the same rows under the new id (shm: through its block tables) while the source stays; a
// fork for another owner (a second client) copies a prefix; taken ids are refused.
TEST_P(KvTransport, ForkCopiesTheRowsUnderANewId) {
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  for (int layer = 0; layer < 2; ++layer) {
    client_->AppendAsync(1, layer, 0, 30, TokenRows(0, 30, 0), TokenRows(0, 30, 1));
  }
  auto copied = client_->Fork(1, 2, Spec(), /*length=*/100);
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_EQ(*copied, 30) << "the appends queued before the fork are in";
  KvClientConfig other = config_;
  other.owner = "test-worker-2";
  auto b = MakeKvStoreClient(other);
  ASSERT_TRUE(b.ok()) << b.status();
  copied = (*b)->Fork(1, 3, Spec(), /*length=*/20);
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_EQ(*copied, 20);
  EXPECT_EQ((*b)->Fork(1, 2, Spec(), 20).status().code(), absl::StatusCode::kAlreadyExists);
  std::vector<int32_t> slots = {19, 0, 5, 19};  // [2 heads, 2]
  for (auto [client, seq] :
       {std::pair{client_.get(), 1}, std::pair{client_.get(), 2}, std::pair{b->get(), 3}}) {
    std::vector<uint8_t> k(4 * 32), v(4 * 32);
    ASSERT_TRUE(
        client->GatherAsync({{static_cast<StoreSequenceId>(seq), 1, 2, slots, k.data(), v.data()}})
            ->Wait(Soon())
            .ok())
        << "sequence " << seq;
    for (int i = 0; i < 4; ++i) {
      const auto want_k = TokenRows(slots[i], 1, 0);
      const auto want_v = TokenRows(slots[i], 1, 1);
      EXPECT_EQ(0, std::memcmp(k.data() + i * 32, want_k.data() + (i / 2) * 32, 32)) << seq;
      EXPECT_EQ(0, std::memcmp(v.data() + i * 32, want_v.data() + (i / 2) * 32, 32)) << seq;
    }
  }
  (*b)->AppendAsync(3, 0, 20, 1, TokenRows(20, 1, 0), TokenRows(20, 1, 1));
  EXPECT_TRUE((*b)->Flush(Soon()).ok());
  EXPECT_TRUE((*b)->Close(3).ok());
  EXPECT_TRUE(client_->Close(2).ok());
  EXPECT_TRUE(client_->Close(1).ok());
}

// Release gives a sequence up after the appends queued before it: the releasing client can no
// longer touch it and its renewals no longer hold it, while another client takes it over whole.
TEST_P(KvTransport, ReleaseLeavesTheRowsForAnotherClient) {
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  for (int layer = 0; layer < 2; ++layer) {
    client_->AppendAsync(1, layer, 0, 30, TokenRows(0, 30, 0), TokenRows(0, 30, 1));
  }
  ASSERT_TRUE(client_->Release(1).ok());
  EXPECT_EQ(client_->Release(9).code(), absl::StatusCode::kNotFound);
  KvClientConfig other = config_;
  other.owner = "test-worker-2";
  auto b = MakeKvStoreClient(other);
  ASSERT_TRUE(b.ok()) << b.status();
  auto kept = (*b)->Attach(1, 2, Spec(), /*max_length=*/100);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, 30) << "the appends queued before the release are in";
  std::vector<int32_t> slots = {29, 0};  // [2 heads, 1]
  std::vector<uint8_t> k(2 * 32), v(2 * 32);
  ASSERT_TRUE((*b)->GatherAsync({{2, 1, 1, slots, k.data(), v.data()}})->Wait(Soon()).ok());
  EXPECT_EQ(0, std::memcmp(k.data(), TokenRows(29, 1, 0).data(), 32));
  EXPECT_TRUE((*b)->Close(2).ok());
}

// In place: transports that map the store's memory (in-process, shm) answer each row's address,
// and the bytes there are the rows, once every append queued before the gather has landed; the
// transports that copy refuse such a gather with a clear error.
TEST_P(KvTransport, InPlaceGathersAnswerRowAddressesOrAreRefused) {
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  client_->AppendAsync(1, 0, 0, 30, TokenRows(0, 30, 0), TokenRows(0, 30, 1));
  for (int64_t t = 30; t < 40; ++t) {
    client_->AppendAsync(1, 0, t, 1, TokenRows(t, 1, 0), TokenRows(t, 1, 1));
  }
  const std::vector<int32_t> slots = {39, 0, 16, 31, 15, 39};  // [2 heads, 3]: across blocks
  std::vector<const void*> k(6), v(6);
  ClientGatherItem item{1, 0, 3, slots};
  item.k_rows = k.data();
  item.v_rows = v.data();
  absl::Status st = client_->GatherAsync({item})->Wait(Soon());
  const bool maps = GetParam() == KvClientConfig::Transport::kInProcess ||
                    GetParam() == KvClientConfig::Transport::kShm;
  EXPECT_EQ(client_->reads_in_place(), maps);
  if (!maps) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("in place"), std::string::npos) << st;
  } else {
    ASSERT_TRUE(st.ok()) << st;
    for (int g = 0; g < 2; ++g) {
      for (int j = 0; j < 3; ++j) {
        const int32_t t = slots[g * 3 + j];
        EXPECT_EQ(0, std::memcmp(k[g * 3 + j], TokenRows(t, 1, 0).data() + g * 32, 32)) << t;
        EXPECT_EQ(0, std::memcmp(v[g * 3 + j], TokenRows(t, 1, 1).data() + g * 32, 32)) << t;
      }
    }
    // Bad indices are refused as for a copying gather.
    item.slots = {0, 0, 0, 40, 0, 0};
    st = client_->GatherAsync({item})->Wait(Soon());
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  }
  EXPECT_TRUE(client_->Close(1).ok());
}

// By block table: the transports that map the store's memory answer the layer's block ids
// (after every append queued before), from the first block the caller does not know yet and
// no further than its table's capacity, and the rows lie in the mapped arena where those ids
// say; bad slots are refused as for any gather; the transports that copy refuse it.
TEST_P(KvTransport, GathersByBlockTableAnswerTheBlocksTheRowsLieIn) {
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  // Rows of 32 bytes in blocks of 16 x 256 bytes: 128 rows a block; 300 rows take 3.
  client_->AppendAsync(1, 1, 0, 290, TokenRows(0, 290, 0), TokenRows(0, 290, 1));
  for (int64_t t = 290; t < 300; ++t) {
    client_->AppendAsync(1, 1, t, 1, TokenRows(t, 1, 0), TokenRows(t, 1, 1));
  }
  constexpr int64_t kCapacity = 4, kHeads = 2;
  std::vector<int32_t> table(2 * kHeads * kCapacity, -7);
  int64_t blocks = -1;
  const std::vector<int32_t> slots = {299, 0, 130, 5, 256, 299};  // [2 heads, 3]
  ClientGatherItem item{1, 1, 3, slots};
  item.block_table = {table.data(), kCapacity, /*known=*/0, &blocks};
  absl::Status st = client_->GatherAsync({item})->Wait(Soon());
  const bool maps = GetParam() == KvClientConfig::Transport::kInProcess ||
                    GetParam() == KvClientConfig::Transport::kShm;
  if (!maps) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("in place"), std::string::npos) << st;
    EXPECT_TRUE(client_->Close(1).ok());
    return;
  }
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(blocks, 3);
  const KvStoreClient::Span arena = client_->mapped_memory();
  ASSERT_EQ(arena.block_bytes, 16u * 256u);
  const int64_t per_block = static_cast<int64_t>(arena.block_bytes) / 32;
  auto row = [&](int kv, int64_t g, int64_t slot) {
    const int32_t id = table[(kv * kHeads + g) * kCapacity + slot / per_block];
    EXPECT_GE(id, 0);
    EXPECT_LT(static_cast<size_t>(id + 1) * arena.block_bytes, arena.bytes + 1);
    return static_cast<const uint8_t*>(arena.data) + static_cast<size_t>(id) * arena.block_bytes +
           (slot % per_block) * 32;
  };
  for (int64_t g = 0; g < kHeads; ++g) {
    for (int64_t slot : {int64_t{0}, int64_t{127}, int64_t{128}, int64_t{255}, int64_t{299}}) {
      EXPECT_EQ(0, std::memcmp(row(0, g, slot), TokenRows(slot, 1, 0).data() + g * 32, 32)) << slot;
      EXPECT_EQ(0, std::memcmp(row(1, g, slot), TokenRows(slot, 1, 1).data() + g * 32, 32)) << slot;
    }
    EXPECT_EQ(table[g * kCapacity + 3], -7) << "no block past the layer's";
  }
  // Two more blocks, answered from the first one the caller lacks; the table has room for 4.
  client_->AppendAsync(1, 1, 300, 260, TokenRows(300, 260, 0), TokenRows(300, 260, 1));
  std::vector<int32_t> answered = table;
  std::fill(table.begin(), table.end(), -7);
  item.slots = {559, 559};
  item.count = 1;
  item.block_table = {table.data(), kCapacity, /*known=*/3, &blocks};
  ASSERT_TRUE(client_->GatherAsync({item})->Wait(Soon()).ok());
  EXPECT_EQ(blocks, 5) << "the layer's blocks, also those past the table's capacity";
  for (int64_t g = 0; g < 2 * kHeads; ++g) {
    for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(table[g * kCapacity + i], -7) << "known: not written";
    EXPECT_GE(table[g * kCapacity + 3], 0);
    answered[g * kCapacity + 3] = table[g * kCapacity + 3];
  }
  table = answered;
  EXPECT_EQ(0, std::memcmp(row(0, 1, 400), TokenRows(400, 1, 0).data() + 32, 32));
  // A slot the layer does not hold is refused, and nothing is answered.
  item.slots = {0, 560};
  blocks = -1;
  st = client_->GatherAsync({item})->Wait(Soon());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(blocks, -1);
  EXPECT_TRUE(client_->Close(1).ok());
}

// Many write-behind appends to both layers, interleaved with gathers of layer 0 that must not
// wait for layer 1's appends but must see every layer-0 append queued before them; the append
// thread sends what piled up in batches. A bad append in the stream fails Flush, naming it.
TEST_P(KvTransport, InterleavedAppendsAndGathersSeeWhatTheyNeed) {
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  std::vector<std::shared_ptr<GatherTicket>> tickets;
  std::vector<std::vector<uint8_t>> ks;
  for (int64_t t = 0; t < 120; ++t) {
    for (int layer = 0; layer < 2; ++layer) {
      client_->AppendAsync(1, layer, t, 1, TokenRows(t + 1000 * layer, 1, 0),
                           TokenRows(t + 1000 * layer, 1, 1));
    }
    if (t % 10 == 9) {  // the newest row of layer 0, just queued
      ks.emplace_back(2 * 32);
      std::vector<uint8_t> v(2 * 32);
      tickets.push_back(client_->GatherAsync({{1,
                                               0,
                                               1,
                                               {static_cast<int32_t>(t), static_cast<int32_t>(t)},
                                               ks.back().data(),
                                               v.data()}}));
      ASSERT_TRUE(tickets.back()->Wait(Soon()).ok());
      const auto want = TokenRows(t, 1, 0);
      EXPECT_EQ(0, std::memcmp(ks.back().data(), want.data(), 32)) << t;
      EXPECT_EQ(0, std::memcmp(ks.back().data() + 32, want.data() + 32, 32)) << t;
    }
  }
  EXPECT_TRUE(client_->Flush(Soon()).ok());
  std::vector<uint8_t> k(2 * 32), v(2 * 32);
  ASSERT_TRUE(client_->GatherAsync({{1, 1, 1, {119, 119}, k.data(), v.data()}})->Wait(Soon()).ok());
  EXPECT_EQ(0, std::memcmp(k.data(), TokenRows(1119, 1, 0).data(), 32));
  // An append past the end (a hole) fails; Flush reports it.
  client_->AppendAsync(1, 0, 500, 1, TokenRows(0, 1, 0), TokenRows(0, 1, 1));
  client_->AppendAsync(1, 0, 120, 1, TokenRows(120, 1, 0), TokenRows(120, 1, 1));
  absl::Status st = client_->Flush(Soon());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(client_->Close(1).ok());
}

// One gather of several items, as a batched prefetch sends: large ones (hundreds of KiB, which
// UCX sends by rendezvous), an empty one and small ones, over two sequences. Every row lands in
// its item's buffers at its place.
TEST_P(KvTransport, ABatchedGatherOfLargeSmallAndEmptyItemsLandsEveryRowInPlace) {
  GatherLargeSmallAndEmptyItems();
}

// A gather whose reply would pass the gRPC reply limit (a dense layer's full read at long
// context passed the channel's 256 MiB) is cut into several calls by rows; every row still
// lands where the caller's buffers expect it. Here with a 16 KiB limit.
TEST_P(KvTransport, GathersLargerThanAReplyGoInSeveralCalls) {
  config_.max_gather_reply_bytes = 16 << 10;
  Reconnect(config_.append_linger);
  GatherLargeSmallAndEmptyItems();
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  if (GetParam() == KvClientConfig::Transport::kGrpc) {
    EXPECT_GT(stats->gathers, 12) << "12 items, several calls each";
  }
}

void KvTransport::GatherLargeSmallAndEmptyItems() {
  constexpr int64_t kTokens = 5000;
  for (StoreSequenceId seq : {1, 2}) {
    ASSERT_TRUE(client_->Open(seq, Spec()).ok());
    for (int64_t t = 0; t < kTokens; t += 1000) {
      for (int layer = 0; layer < 2; ++layer) {
        const int64_t tag = t + 10000 * layer + 100000 * seq;
        client_->AppendAsync(seq, layer, t, 1000, TokenRows(tag, 1000, 0), TokenRows(tag, 1000, 1));
      }
    }
  }
  ASSERT_TRUE(client_->Flush(Soon()).ok());
  struct Want {
    StoreSequenceId seq;
    int layer;
    int64_t count;
  };
  // Over UCX: large items travel alone, two messages each; runs of small ones (under 128 KiB of
  // K rows: here 1500 rows and fewer) several to a message of up to 1 MiB.
  const std::vector<Want> wants = {{1, 0, 4000}, {2, 1, 0},    {2, 0, 3},    {1, 1, 2500},
                                   {1, 0, 1500}, {2, 1, 1500}, {1, 1, 1500}, {2, 0, 1500},
                                   {1, 0, 1500}, {2, 1, 1500}, {1, 1, 1500}, {2, 0, 7}};
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> slots;
  std::vector<std::vector<uint8_t>> ks, vs;
  std::vector<ClientGatherItem> items;
  for (const Want& w : wants) {
    slots.emplace_back(2 * w.count);
    for (int32_t& s : slots.back()) s = static_cast<int32_t>(rng() % kTokens);
    ks.emplace_back(2 * w.count * 32, 0);
    vs.emplace_back(2 * w.count * 32, 0);
    items.push_back({w.seq, w.layer, w.count, slots.back(), ks.back().data(), vs.back().data()});
  }
  ASSERT_TRUE(client_->GatherAsync(items)->Wait(Soon()).ok());
  for (size_t i = 0; i < wants.size(); ++i) {
    const Want& w = wants[i];
    for (int g = 0; g < 2; ++g) {
      for (int64_t j = 0; j < w.count; ++j) {
        const int32_t t = slots[i][g * w.count + j];
        const int64_t tag = t + 10000 * w.layer + 100000 * static_cast<int64_t>(w.seq);
        const size_t at = (g * w.count + j) * 32;
        ASSERT_EQ(0, std::memcmp(ks[i].data() + at, TokenRows(tag, 1, 0).data() + g * 32, 32))
            << "item " << i << " head " << g << " row " << j;
        ASSERT_EQ(0, std::memcmp(vs[i].data() + at, TokenRows(tag, 1, 1).data() + g * 32, 32))
            << "item " << i << " head " << g << " row " << j;
      }
    }
  }
}

// Appends that linger for company (a minute here) still go at once when a gather needs one of
// them, together with everything queued before, and when the client is destroyed.
TEST_P(KvTransport, LingeringAppendsGoWhenAGatherNeedsThemOrTheClientCloses) {
  Reconnect(absl::Minutes(1));
  const bool queued = GetParam() != KvClientConfig::Transport::kInProcess;
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  for (int layer = 0; layer < 2; ++layer) {
    client_->AppendAsync(1, layer, 0, 10, TokenRows(100 * layer, 10, 0),
                         TokenRows(100 * layer, 10, 1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(store_->Stats().appends, queued ? 0 : 2) << "queued appends linger";

  const absl::Time start = absl::Now();
  std::vector<uint8_t> k(2 * 32), v(2 * 32);
  ASSERT_TRUE(client_->GatherAsync({{1, 1, 1, {9, 9}, k.data(), v.data()}})->Wait(Soon()).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "the gather did not wait out the linger";
  EXPECT_EQ(0, std::memcmp(k.data(), TokenRows(109, 1, 0).data(), 32));
  EXPECT_EQ(store_->Stats().appends, 2) << "layer 0's append, queued first, went along";

  client_->AppendAsync(1, 0, 10, 1, TokenRows(10, 1, 0), TokenRows(10, 1, 1));
  const absl::Time closing = absl::Now();
  client_.reset();
  EXPECT_LT(absl::Now() - closing, absl::Seconds(5));
  EXPECT_EQ(store_->Stats().appends, 3) << "a closing client sends what lingers";
  EXPECT_EQ(store_->Stats().tokens_stored, 11);
}

TEST_P(KvTransport, BadRequestsGetClearErrors) {
  ASSERT_TRUE(client_->Open(2, Spec()).ok());
  client_->AppendAsync(2, 0, 0, 4, TokenRows(0, 4, 0), TokenRows(0, 4, 1));
  std::vector<uint8_t> k(64), v(64);
  auto unknown = client_->GatherAsync({{99, 0, 1, {0, 0}, k.data(), v.data()}});
  EXPECT_EQ(unknown->Wait(Soon()).code(), absl::StatusCode::kNotFound);
  auto range = client_->GatherAsync({{2, 0, 1, {0, 4}, k.data(), v.data()}});
  EXPECT_EQ(range->Wait(Soon()).code(), absl::StatusCode::kInvalidArgument);
  auto layer = client_->GatherAsync({{2, 5, 1, {0, 0}, k.data(), v.data()}});
  EXPECT_EQ(layer->Wait(Soon()).code(), absl::StatusCode::kInvalidArgument);
  // A count whose product with 4 KV heads wraps around to the 4 indices given.
  SequenceSpec four = Spec();
  four.num_kv_heads = 4;
  ASSERT_TRUE(client_->Open(5, four).ok());
  client_->AppendAsync(5, 0, 0, 1, TokenRows(0, 2, 0), TokenRows(0, 2, 1));  // 4 heads x 32 B
  ASSERT_TRUE(client_->Flush(Soon()).ok());
  std::vector<uint8_t> k4(4 * 32, 0xee), v4(4 * 32, 0xee);
  auto wraps =
      client_->GatherAsync({{5, 0, (int64_t{1} << 62) + 1, {0, 0, 0, 0}, k4.data(), v4.data()}});
  EXPECT_EQ(wraps->Wait(Soon()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(k4, std::vector<uint8_t>(4 * 32, 0xee));
  auto fine = client_->GatherAsync({{5, 0, 1, {0, 0, 0, 0}, k4.data(), v4.data()}});
  EXPECT_TRUE(fine->Wait(Soon()).ok());
  // A malformed append (one byte short) is reported by the next Flush, and only once.
  auto short_k = TokenRows(4, 1, 0);
  short_k.pop_back();
  client_->AppendAsync(2, 0, 4, 1, short_k, short_k);
  EXPECT_EQ(client_->Flush(Soon()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(client_->Flush(Soon()).ok());
  EXPECT_EQ(client_->Open(2, Spec()).code(), absl::StatusCode::kAlreadyExists);
}

// One sequence's failed append fails no other sequence, even when their appends travel in one
// batch (the linger holds them until a gather needs them), and a gather that misses the rows of
// a failed append names that failure rather than blaming the caller's indices.
TEST_P(KvTransport, AFailedAppendFailsOnlyItsSequenceAndItsGathersSayWhy) {
  Reconnect(absl::Seconds(10));
  ASSERT_TRUE(client_->Open(10, Spec()).ok());
  ASSERT_TRUE(client_->Open(11, Spec()).ok());
  client_->AppendAsync(10, 0, 0, 4, TokenRows(0, 4, 0), TokenRows(0, 4, 1));
  client_->AppendAsync(11, 0, 0, 4, TokenRows(0, 4, 0), TokenRows(0, 4, 1));
  ASSERT_TRUE(client_->Flush(Soon()).ok());
  client_->AppendAsync(10, 0, 7, 1, TokenRows(7, 1, 0), TokenRows(7, 1, 1));  // not in order
  client_->AppendAsync(11, 0, 4, 1, TokenRows(4, 1, 0), TokenRows(4, 1, 1));
  std::vector<uint8_t> k(64), v(64);
  auto healthy = client_->GatherAsync({{11, 0, 1, {4, 4}, k.data(), v.data()}});
  const absl::Status ok = healthy->Wait(Soon());
  ASSERT_TRUE(ok.ok()) << ok;
  EXPECT_EQ(k, TokenRows(4, 1, 0));
  auto broken = client_->GatherAsync({{10, 0, 1, {7, 7}, k.data(), v.data()}});
  const absl::Status why = broken->Wait(Soon());
  EXPECT_EQ(why.code(), absl::StatusCode::kInvalidArgument) << why;
  EXPECT_NE(why.message().find("an append to sequence 10 failed before it"), std::string::npos)
      << why;
  EXPECT_EQ(client_->Flush(Soon()).code(), absl::StatusCode::kInvalidArgument);
  // Closed and opened anew, the sequence is healthy again.
  ASSERT_TRUE(client_->Close(10).ok());
  ASSERT_TRUE(client_->Open(10, Spec()).ok());
  client_->AppendAsync(10, 0, 0, 1, TokenRows(0, 1, 0), TokenRows(0, 1, 1));
  auto fresh = client_->GatherAsync({{10, 0, 1, {3, 3}, k.data(), v.data()}});
  const absl::Status plain = fresh->Wait(Soon());
  EXPECT_EQ(plain.code(), absl::StatusCode::kInvalidArgument) << plain;
  EXPECT_EQ(plain.message().find("an append"), std::string::npos) << plain;
}

TEST_P(KvTransport, AFullStoreRefusesWithoutLosingOtherSequences) {
  ASSERT_TRUE(client_->Open(3, Spec()).ok());
  client_->AppendAsync(3, 0, 0, 16, TokenRows(0, 16, 0), TokenRows(0, 16, 1));
  ASSERT_TRUE(client_->Open(4, Spec()).ok());
  int64_t t = 0;
  absl::Status st;
  while (st.ok() && t < 100000) {
    client_->AppendAsync(4, 0, t, 64, TokenRows(t, 64, 0), TokenRows(t, 64, 1));
    st = client_->Flush(Soon());
    t += 64;
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  std::vector<int32_t> slots = {15, 0};
  std::vector<uint8_t> k(64), v(64);
  auto ticket = client_->GatherAsync({{3, 0, 1, slots, k.data(), v.data()}});
  ASSERT_TRUE(ticket->Wait(Soon()).ok());
  EXPECT_EQ(0, std::memcmp(k.data(), TokenRows(15, 1, 0).data(), 32));
}

// An 8 MiB store of 16-token blocks, rows up to 64 bytes, for tests of one service or channel.
std::unique_ptr<KvStore> SmallStore() {
  KvStoreConfig c;
  c.capacity_bytes = 8 << 20;
  c.block_tokens = 16;
  c.max_row_bytes = 64;
  c.huge_pages = false;
  return std::move(*KvStore::Create(c));
}

// The service refuses what it would have to allocate too much for, before allocating it: a
// gather whose rows exceed the message limit (2^22 + 1 indices of 32-byte rows: 256 MiB and 64
// bytes of K and V) and an append whose byte count does not match its token count.
TEST(KvStoreServiceLimits, OversizedGathersAndMismatchedAppendsAreRefusedFirst) {
  auto store = SmallStore();
  KvStoreService service(*store);
  kvstore::v1::OpenRequest open;
  open.set_sequence_id(1);
  open.set_num_layers(1);
  open.set_num_kv_heads(1);
  open.set_head_dim(16);
  open.set_dtype(kvstore::v1::DTYPE_BF16);
  kvstore::v1::OpenResponse opened;
  grpc::ServerContext ctx;
  ASSERT_TRUE(service.Open(&ctx, &open, &opened).ok());
  kvstore::v1::GatherRequest gather;
  auto* item = gather.add_items();
  item->set_sequence_id(1);
  item->set_count((int64_t{1} << 22) + 1);
  item->mutable_slots()->Resize((1 << 22) + 1, 0);
  kvstore::v1::GatherResponse gathered;
  const grpc::Status g = service.Gather(&ctx, &gather, &gathered);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << g.error_message();
  EXPECT_EQ(gathered.results_size(), 0);
  kvstore::v1::AppendRequest append;
  append.set_sequence_id(1);
  append.set_num_tokens(1 << 24);  // with 32 bytes of k and v
  append.set_k(std::string(32, 'k'));
  append.set_v(std::string(32, 'v'));
  kvstore::v1::AppendResponse appended;
  const grpc::Status a = service.Append(&ctx, &append, &appended);
  EXPECT_EQ(a.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << a.error_message();
  EXPECT_NE(a.error_message().find("bytes each"), std::string::npos) << a.error_message();
}

// A collocated client's staged appends (kv_store/staging_file.h): the store names its staging
// folder (an arena shared through /proc: /dev/shm), reads each staged append's rows from the
// caller's file, and refuses what it must not read: a file outside the folder or not named as a
// staging file (the whole call, nothing applied), one it cannot open, and rows outside the file
// (that append alone, the others applied).
TEST(KvStoreServiceLimits, StagedAppendsAreReadFromTheCallersFileOrRefused) {
  auto store = SmallStore();
  KvStoreService service(*store);
  grpc::ServerContext ctx;
  kvstore::v1::DescribeResponse described;
  ASSERT_TRUE(service.Describe(&ctx, nullptr, &described).ok());
  ASSERT_EQ(described.staging_dir(), "/dev/shm");
  auto writer = StagingWriter::Create(described.staging_dir(), 4096);
  ASSERT_TRUE(writer.ok()) << writer.status();
  SequenceSpec spec;
  spec.num_layers = 1;
  spec.num_kv_heads = 1;
  spec.head_dim = 16;
  spec.dtype = DType::kBF16;
  for (StoreSequenceId seq : {1, 2}) ASSERT_TRUE(store->Open(seq, spec, absl::Now()).ok());
  uint8_t* file = (*writer)->data();
  for (int b = 0; b < 128; ++b) file[b] = static_cast<uint8_t>(b);  // K then V of 2 tokens
  auto batch = [&](const std::string& path) {
    kvstore::v1::AppendBatchRequest req;
    req.set_staging_file(path);
    for (auto [seq, start, offset] :
         {std::tuple{1, 0, 0}, std::tuple{2, 0, 4096 - 48}, std::tuple{1, 1, 64}}) {
      auto* a = req.add_appends();
      a->set_sequence_id(seq);
      a->set_start(start);
      a->set_num_tokens(1);
      a->set_staged_offset(offset);
      a->set_staged_bytes(32);
    }
    return req;
  };
  for (const std::string bad :
       {std::string("/tmp/infinigen-staging-1"),
        std::string("/dev/shm/infinigen-staging-../kvstore"), std::string("/dev/shm/other-file")}) {
    kvstore::v1::AppendBatchResponse resp;
    const kvstore::v1::AppendBatchRequest req = batch(bad);
    const grpc::Status st = service.AppendBatch(&ctx, &req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << bad << ": " << st.error_message();
  }
  kvstore::v1::AppendBatchResponse missing;
  const kvstore::v1::AppendBatchRequest nowhere = batch("/dev/shm/infinigen-staging-none");
  EXPECT_EQ(service.AppendBatch(&ctx, &nowhere, &missing).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // Not a regular file of the store's user under the name: a link to the real one, a FIFO (the
  // store must not block on it).
  const std::string link = absl::StrCat("/dev/shm/", kStagingFilePrefix, "link-", ::getpid());
  const std::string fifo = absl::StrCat("/dev/shm/", kStagingFilePrefix, "fifo-", ::getpid());
  std::filesystem::remove(link);
  std::filesystem::remove(fifo);
  std::filesystem::create_symlink((*writer)->path(), link);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {link, fifo}) {
    kvstore::v1::AppendBatchResponse resp;
    const kvstore::v1::AppendBatchRequest req = batch(path);
    EXPECT_EQ(service.AppendBatch(&ctx, &req, &resp).error_code(), grpc::StatusCode::NOT_FOUND)
        << path;
  }
  std::filesystem::remove(link);
  std::filesystem::remove(fifo);
  EXPECT_EQ(store->Stats().tokens_stored, 0) << "nothing applied";
  kvstore::v1::AppendBatchResponse resp;
  const kvstore::v1::AppendBatchRequest good = batch((*writer)->path());
  ASSERT_TRUE(service.AppendBatch(&ctx, &good, &resp).ok());
  EXPECT_EQ(resp.applied(), 2);
  ASSERT_EQ(resp.failures_size(), 1);
  EXPECT_EQ(resp.failures(0).index(), 1) << "its V past the file's end";
  EXPECT_EQ(resp.failures(0).code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Its name removed (the client does after the first call), the store reads its mapping;
  // once the client says it moved on, the store lets the mapping go and no longer finds it.
  (*writer)->Unlink();
  kvstore::v1::AppendBatchRequest again = batch((*writer)->path());
  again.mutable_appends()->DeleteSubrange(0, 2);  // sequence 1's second token again: refused
  kvstore::v1::AppendBatchResponse mapped;
  ASSERT_TRUE(service.AppendBatch(&ctx, &again, &mapped).ok()) << "still mapped";
  again.set_staging_file("");
  again.mutable_appends(0)->set_staged_bytes(0);
  again.mutable_appends(0)->set_staged_offset(0);
  again.set_released_staging_file((*writer)->path());
  ASSERT_TRUE(service.AppendBatch(&ctx, &again, &mapped).ok());
  const kvstore::v1::AppendBatchRequest gone = batch((*writer)->path());
  EXPECT_EQ(service.AppendBatch(&ctx, &gone, &mapped).error_code(), grpc::StatusCode::NOT_FOUND);
  // Sequence 1's two tokens are the file's bytes: K [0, 32) and V [32, 64), then [64, 128).
  std::vector<uint8_t> k(64), v(64);
  const int32_t both[2] = {0, 1};
  GatherItem item{1, 0, 2, both, k.data(), v.data()};
  ASSERT_TRUE(store->Gather({&item, 1}).ok());
  for (int b = 0; b < 32; ++b) {
    EXPECT_EQ(k[b], b);
    EXPECT_EQ(v[b], 32 + b);
    EXPECT_EQ(k[32 + b], 64 + b);
    EXPECT_EQ(v[32 + b], 96 + b);
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, KvTransport,
                         ::testing::Values(KvClientConfig::Transport::kInProcess,
                                           KvClientConfig::Transport::kGrpc,
                                           KvClientConfig::Transport::kShm
#if INFINIGEN_HAVE_UCX
                                           ,
                                           KvClientConfig::Transport::kUcx
#endif
                                           ),
                         [](const auto& info) {
                           switch (info.param) {
                             case KvClientConfig::Transport::kInProcess:
                               return std::string("InProcess");
                             case KvClientConfig::Transport::kGrpc:
                               return std::string("Grpc");
                             case KvClientConfig::Transport::kShm:
                               return std::string("Shm");
                             case KvClientConfig::Transport::kUcx:
                               return std::string("Ucx");
                           }
                           return std::string("?");
                         });

}  // namespace
}  // namespace infinigen
