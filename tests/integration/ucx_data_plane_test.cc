// The UCX data plane against real peers on loopback: malformed requests and append messages
// get errors and the store serves on, the endpoints of workers that leave are closed, a gather
// the store does not answer waits asleep until its deadline, and a client's append batches cross
// in one UCX message each (rows after the request) where the store takes them, over gRPC where
// it does not, landing byte for byte either way. The suite
// every transport runs (the UCX client included) is kv_transport_test.cc.
#include "kv_store/ucx/ucx_data_plane.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstring>
#include <ctime>
#include <random>
#include <thread>

#include "infinigen/kvstore/v1/kvstore.pb.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/service/kvstore_service.h"
#include "kv_store/ucx/ucx_common.h"
#include "kv_store/ucx/ucx_wire.h"

namespace infinigen {
namespace {

namespace pb = kvstore::v1;

// An 8 MiB store of 16-token blocks holding sequence 1: one layer of `heads` KV heads of 32-byte
// rows, one token whose rows are all 7s.
std::unique_ptr<KvStore> StoreWithOneToken(int heads) {
  KvStoreConfig c;
  c.capacity_bytes = 8 << 20;
  c.block_tokens = 16;
  c.max_row_bytes = 64;
  c.huge_pages = false;
  auto store = std::move(*KvStore::Create(c));
  SequenceSpec spec;
  spec.num_layers = 1;
  spec.num_kv_heads = heads;
  spec.head_dim = 16;
  spec.dtype = DType::kBF16;
  EXPECT_TRUE(store->Open(1, spec, absl::Now()).ok());
  const std::vector<uint8_t> rows(heads * 32, 7);
  EXPECT_TRUE(store->Append(1, 0, 0, 1, rows.data(), rows.data(), rows.size()).ok());
  return store;
}

// A raw UCX peer that sends the store request bytes no worker would send.
class RawUcxPeer {
 public:
  explicit RawUcxPeer(int port) {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    ucp_config_t* config = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    EXPECT_EQ(ucp_init(&params, config, &context_), UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    EXPECT_EQ(ucp_worker_create(context_, &wp, &worker_), UCS_OK);
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = kGatherReply;
    hp.cb = [](void* arg, const void* header, size_t header_length, void* data, size_t length,
               const ucp_am_recv_param_t*) -> ucs_status_t {
      auto* self = static_cast<RawUcxPeer*>(arg);
      ReplyHeader h{};
      if (header_length == sizeof(h)) std::memcpy(&h, header, sizeof(h));
      self->reply_ = absl::Status(static_cast<absl::StatusCode>(h.code),
                                  std::string(static_cast<const char*>(data), length));
      self->answer_.assign(static_cast<const char*>(data), length);
      self->replied_ = true;
      return UCS_OK;
    };
    hp.arg = this;
    EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &hp), UCS_OK);
    hp.id = kAppendReply;  // the same header
    EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &hp), UCS_OK);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    ep.sockaddr.addrlen = sizeof(addr);
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    EXPECT_EQ(ucp_ep_create(worker_, &ep, &ep_), UCS_OK);
  }
  ~RawUcxPeer() {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep_, &rp);
    while (r != nullptr && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS) {
      ucp_worker_progress(worker_);
    }
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
    for (ucs_status_ptr_t p : pending_) ucp_request_free(p);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }
  // Sends one gather request and returns the store's answer (its code and text), or
  // DEADLINE_EXCEEDED.
  absl::Status Request(const std::vector<uint8_t>& payload) {
    RequestHeader header{++id_, 1 << 20};
    return Send(kGatherRequest, &header, sizeof(header), payload.data(), payload.size());
  }
  // Sends one append message under `header` (its id is set here) and returns the answer.
  absl::Status Append(AppendHeader header, const void* payload, size_t length) {
    header.id = ++id_;
    return Send(kAppendRequest, &header, sizeof(header), payload, length, /*eager=*/false);
  }
  const std::string& answer() const { return answer_; }

 private:
  absl::Status Send(unsigned id, const void* header, size_t header_length, const void* payload,
                    size_t length, bool eager = true) {
    replied_ = false;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | (eager ? UCP_AM_SEND_FLAG_EAGER : 0);
    ucs_status_ptr_t send = ucp_am_send_nbx(ep_, id, header, header_length, payload, length, &rp);
    auto sending = [&] {
      return send != nullptr && !UCS_PTR_IS_ERR(send) &&
             ucp_request_check_status(send) == UCS_INPROGRESS;
    };
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (!replied_ && absl::Now() < deadline) ucp_worker_progress(worker_);
    const absl::Time sent_by = absl::Now() + absl::Milliseconds(500);
    while (sending() && absl::Now() < sent_by) ucp_worker_progress(worker_);
    if (send != nullptr && !UCS_PTR_IS_ERR(send)) {
      // A message the store refused unread may leave its send pending: the close ends it.
      if (ucp_request_check_status(send) != UCS_INPROGRESS) {
        ucp_request_free(send);
      } else {
        pending_.push_back(send);
      }
    }
    if (!replied_) return absl::DeadlineExceededError("no reply");
    return reply_;
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  uint64_t id_ = 0;
  bool replied_ = false;
  absl::Status reply_;
  std::string answer_;
  std::vector<ucs_status_ptr_t> pending_;  // sends not done at their answer: freed after the close
};

// Request bytes no worker sends get an error reply naming what is wrong, and the store keeps
// serving: before the request codec, 2^32 - 1 announced items made the store allocate ~190 GiB
// inside a UCX callback (std::terminate), and a count wrapping around with the heads passed.
TEST(UcxDataPlane, MalformedRequestsGetErrorsAndTheStoreServesOn) {
  setenv("UCX_NET_DEVICES", "lo", 0);
  auto store = StoreWithOneToken(4);
  const std::vector<uint8_t> rows(4 * 32, 7);
  auto server = UcxDataServer::Start(*store, 0);
  ASSERT_TRUE(server.ok()) << server.status();
  RawUcxPeer peer((*server)->port());
  std::vector<uint8_t> many;
  PutItemCount(many, 0xffffffffu);
  many.resize(16, 0xab);
  const absl::Status items = peer.Request(many);
  EXPECT_EQ(items.code(), absl::StatusCode::kInvalidArgument) << items;
  EXPECT_NE(items.message().find("malformed gather request"), std::string::npos) << items;
  std::vector<uint8_t> wraps;
  PutItemCount(wraps, 1);
  const std::vector<int32_t> four = {0, 0, 0, 0};
  PutGatherItem(wraps, 1, 0, (int64_t{1} << 62) + 1, four);  // x 4 heads = 2^64 + 4
  const absl::Status count = peer.Request(wraps);
  EXPECT_EQ(count.code(), absl::StatusCode::kInvalidArgument) << count;
  std::vector<uint8_t> unknown;
  PutItemCount(unknown, 1);
  PutGatherItem(unknown, 99, 0, 1, four);
  EXPECT_EQ(peer.Request(unknown).code(), absl::StatusCode::kNotFound);
  // A worker's channel is served as before.
  auto channel = UcxDataChannel::Connect("127.0.0.1", (*server)->port());
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::vector<uint8_t> k(4 * 32), v(4 * 32);
  std::vector<ClientGatherItem> ok = {{1, 0, 1, four, k.data(), v.data()}};
  ASSERT_TRUE((*channel)->Gather(ok, {32}, absl::Seconds(5)).ok());
  EXPECT_EQ(k, rows);
}

// A worker's UCX channel that goes away (a crash, or a broken channel dropped to reconnect)
// leaves no endpoint behind in the store, and the store keeps serving the next one.
TEST(UcxDataPlane, EndpointsOfWorkersThatLeaveAreClosed) {
  auto store = StoreWithOneToken(1);
  const std::vector<uint8_t> row(32, 7);
  auto server = UcxDataServer::Start(*store, 0);
  ASSERT_TRUE(server.ok()) << server.status();
  auto wait_for = [&](int workers) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while ((*server)->connected_workers() != workers && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return (*server)->connected_workers();
  };
  for (int round = 0; round < 3; ++round) {
    auto channel = UcxDataChannel::Connect("127.0.0.1", (*server)->port());
    ASSERT_TRUE(channel.ok()) << channel.status();
    std::vector<uint8_t> k(32), v(32);
    std::vector<ClientGatherItem> items = {{1, 0, 1, {0}, k.data(), v.data()}};
    ASSERT_TRUE((*channel)->Gather(items, {32}, absl::Seconds(5)).ok()) << "round " << round;
    EXPECT_EQ(k, row);
    EXPECT_EQ(wait_for(1), 1) << "round " << round;
    channel->reset();
    EXPECT_EQ(wait_for(0), 0) << "round " << round << ": the store kept the endpoint";
  }
}

// A UCX peer that takes workers' connections and never answers their gathers (a store that is
// frozen, or busy with other workers' rows), progressed by its own thread.
class SilentUcxStore {
 public:
  SilentUcxStore() {
    EXPECT_TRUE(InitUcxWorker(&context_, &worker_).ok());
    EXPECT_TRUE(SetUcxAmHandler(
                    worker_, kGatherRequest,
                    [](void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) {
                      return UCS_OK;  // dropped: no answer
                    },
                    nullptr)
                    .ok());
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    lp.sockaddr.addrlen = sizeof(addr);
    lp.conn_handler.cb = [](ucp_conn_request_h request, void* arg) {
      auto* self = static_cast<SilentUcxStore*>(arg);
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      ep.conn_request = request;
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ucp_ep_h handle;
      if (ucp_ep_create(self->worker_, &ep, &handle) == UCS_OK) self->endpoints_.push_back(handle);
    };
    lp.conn_handler.arg = this;
    EXPECT_EQ(ucp_listener_create(worker_, &lp, &listener_), UCS_OK);
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    EXPECT_EQ(ucp_listener_query(listener_, &attr), UCS_OK);
    port_ = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
    progress_ = std::thread([this] {
      while (!stop_.load()) {
        if (ucp_worker_progress(worker_) == 0) absl::SleepFor(absl::Microseconds(100));
      }
    });
  }
  ~SilentUcxStore() {
    stop_.store(true);
    progress_.join();
    ucp_listener_destroy(listener_);
    for (ucp_ep_h ep : endpoints_) CloseUcxEndpoint(worker_, ep);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }
  int port() const { return port_; }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  std::vector<ucp_ep_h> endpoints_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// A gather the store does not answer spins a few milliseconds, then waits asleep: on a worker
// the prefetch waits beside the layer before it, whose compute (and the store, sending other
// workers' rows) wants the cores. It still ends at its deadline. Spinning throughout, the wait
// took 0.599 s of CPU in its 0.600 s.
TEST(UcxDataPlane, AGatherTheStoreDoesNotAnswerWaitsAsleepUntilItsDeadline) {
  setenv("UCX_NET_DEVICES", "lo", 0);
  SilentUcxStore silent;
  auto channel = UcxDataChannel::Connect("127.0.0.1", silent.port());
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::vector<uint8_t> k(32), v(32);
  std::vector<ClientGatherItem> items = {{1, 0, 1, {0}, k.data(), v.data()}};
  const double cpu = ThreadCpuSeconds();
  const absl::Time start = absl::Now();
  const absl::Status status = (*channel)->Gather(items, {32}, absl::Milliseconds(600));
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);
  const double used = ThreadCpuSeconds() - cpu;
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_GE(wall, 0.6);
  EXPECT_LT(wall, 2.0);
  EXPECT_LT(used, 0.15 * wall) << "the wait used " << used << " s of CPU in " << wall << " s";
}

// A store behind a real gRPC server and a UCX data plane that applies appends through the
// service (as the store's main does), and a UCX client of it.
class UcxAppends : public ::testing::Test {
 protected:
  void SetUp() override { setenv("UCX_NET_DEVICES", "lo", 0); }
  void Start(bool ucx_appends) {
    KvStoreConfig c;
    c.capacity_bytes = 64 << 20;
    c.block_tokens = 16;
    c.max_row_bytes = 256;
    c.huge_pages = false;
    store_ = std::move(*KvStore::Create(c));
    service_ = std::make_unique<KvStoreService>(*store_);
    auto ucx = UcxDataServer::Start(
        *store_, 0, [this](std::span<const uint8_t> request, std::span<const uint8_t> rows) {
          return service_->AppendBatchWithRows(request, rows);
        });
    ASSERT_TRUE(ucx.ok()) << ucx.status();
    ucx_ = std::move(*ucx);
    service_->set_ucx_port(ucx_->port(), ucx_appends);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(256 << 20);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    KvClientConfig cc;
    cc.transport = KvClientConfig::Transport::kUcx;
    cc.address = "127.0.0.1:" + std::to_string(port);
    cc.owner = "test-worker";
    cc.renew_every = absl::ZeroDuration();
    auto client = MakeKvStoreClient(cc);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  void TearDown() override {
    client_.reset();
    if (server_) server_->Shutdown();
    ucx_.reset();
  }
  static SequenceSpec Spec() {
    SequenceSpec s;
    s.num_layers = 2;
    s.num_kv_heads = 4;
    s.head_dim = 64;
    s.dtype = DType::kBF16;  // 128-byte rows, 512 bytes a token
    return s;
  }
  // A prompt of `tokens` tokens into both layers, then `decodes` one-token appends, all write-
  // behind; then every row gathered back and compared.
  void AppendThenReadBack(StoreSequenceId seq, int64_t tokens, int decodes) {
    ASSERT_TRUE(client_->Open(seq, Spec()).ok());
    const int64_t token_bytes = 4 * 128;
    std::mt19937 rng(static_cast<uint32_t>(seq));
    std::vector<uint8_t> k((tokens + decodes) * token_bytes), v(k.size());
    for (auto& b : k) b = static_cast<uint8_t>(rng());
    for (auto& b : v) b = static_cast<uint8_t>(rng());
    for (int layer = 0; layer < 2; ++layer) {
      client_->AppendAsync(seq, layer, 0, tokens, {k.data(), size_t(tokens * token_bytes)},
                           {v.data(), size_t(tokens * token_bytes)});
    }
    for (int d = 0; d < decodes; ++d) {
      const size_t at = (tokens + d) * token_bytes;
      for (int layer = 0; layer < 2; ++layer) {
        client_->AppendAsync(seq, layer, tokens + d, 1, {k.data() + at, size_t(token_bytes)},
                             {v.data() + at, size_t(token_bytes)});
      }
    }
    ASSERT_TRUE(client_->Flush(absl::Now() + absl::Seconds(30)).ok());
    const int64_t n = tokens + decodes;
    std::vector<int32_t> slots(4 * n);
    for (int h = 0; h < 4; ++h) {
      for (int64_t t = 0; t < n; ++t) slots[h * n + t] = static_cast<int32_t>(t);
    }
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<uint8_t> got_k(k.size()), got_v(v.size());  // [heads, n, 128]
      auto ticket = client_->GatherAsync({{seq, layer, n, slots, got_k.data(), got_v.data()}});
      ASSERT_TRUE(ticket->Wait(absl::Now() + absl::Seconds(30)).ok());
      for (int h = 0; h < 4; ++h) {
        for (int64_t t = 0; t < n; ++t) {  // stored [n, heads, 128]
          ASSERT_EQ(
              0, std::memcmp(got_k.data() + (h * n + t) * 128, k.data() + (t * 4 + h) * 128, 128))
              << "layer " << layer << " head " << h << " token " << t;
          ASSERT_EQ(
              0, std::memcmp(got_v.data() + (h * n + t) * 128, v.data() + (t * 4 + h) * 128, 128));
        }
      }
    }
  }

  std::unique_ptr<KvStore> store_;
  std::unique_ptr<KvStoreService> service_;
  std::unique_ptr<UcxDataServer> ucx_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<KvStoreClient> client_;
};

// A 4 MiB prompt (rendezvous: read in place) and 24 decode steps' rows cross as append messages
// over UCX, never through protobuf over gRPC, and every row reads back as written.
TEST_F(UcxAppends, BatchesCrossInOneUcxMessageEachAndLandExactly) {
  Start(/*ucx_appends=*/true);
  AppendThenReadBack(1, 4096, 24);
  EXPECT_GT(ucx_->append_batches(), 0);
  const KvStoreStats stats = *client_->Stats();
  EXPECT_EQ(stats.tokens_stored, 4096 + 24);  // layer 0's rows
}

// Decode steps over UCX: each appends a token and gathers every row of the layer, a little more
// than the step before. The store answers them from one reply buffer; sized exactly, each step
// mapped a new one (32 here) and unmapped the oldest.
TEST_F(UcxAppends, TheGathersOfAGrowingSequenceReuseTheStoresReplyBuffer) {
  Start(/*ucx_appends=*/true);
  constexpr int64_t kPrompt = 1500, kSteps = 32, kTokenBytes = 4 * 128;
  ASSERT_TRUE(client_->Open(1, Spec()).ok());
  std::vector<uint8_t> k((kPrompt + kSteps) * kTokenBytes, 3), v(k.size(), 5);
  auto append = [&](int64_t first, int64_t n) {
    for (int layer = 0; layer < 2; ++layer) {
      client_->AppendAsync(1, layer, first, n,
                           {k.data() + first * kTokenBytes, size_t(n * kTokenBytes)},
                           {v.data() + first * kTokenBytes, size_t(n * kTokenBytes)});
    }
  };
  append(0, kPrompt);
  const int64_t mapped_before = ucx_->reply_buffers_mapped();
  std::vector<uint8_t> got_k(k.size()), got_v(v.size());
  for (int64_t n = kPrompt; n < kPrompt + kSteps; ++n) {
    append(n, 1);
    const int64_t rows = n + 1;
    std::vector<int32_t> slots(4 * rows);
    for (int h = 0; h < 4; ++h) {
      for (int64_t t = 0; t < rows; ++t) slots[h * rows + t] = static_cast<int32_t>(t);
    }
    auto ticket = client_->GatherAsync({{1, 0, rows, slots, got_k.data(), got_v.data()}});
    ASSERT_TRUE(ticket->Wait(absl::Now() + absl::Seconds(30)).ok()) << "step " << n;
    ASSERT_EQ(got_k[(rows * 4 - 1) * 128], 3) << "the step's last row, head 3";
    ASSERT_EQ(got_v[(rows * 4 - 1) * 128], 5);
  }
  EXPECT_LE(ucx_->reply_buffers_mapped() - mapped_before, 2) << kSteps << " gathers, each larger";
}

// A store that does not say it takes appends over UCX (an older one) gets them over gRPC.
TEST_F(UcxAppends, AStoreThatTakesNoneOverUcxGetsThemOverGrpc) {
  Start(/*ucx_appends=*/false);
  AppendThenReadBack(1, 300, 5);
  EXPECT_EQ(ucx_->append_batches(), 0);
}

// A store whose UCX data plane comes back taking no appends (a rollback to an older build) gets
// the client's appends over gRPC from its first batch after the client noticed, not failures.
TEST_F(UcxAppends, AStoreThatStopsTakingThemOverUcxGetsThemOverGrpc) {
  Start(/*ucx_appends=*/true);
  AppendThenReadBack(1, 64, 2);
  ASSERT_GT(ucx_->append_batches(), 0);
  ucx_.reset();
  auto older = UcxDataServer::Start(*store_, 0);  // no append handler
  ASSERT_TRUE(older.ok()) << older.status();
  ucx_ = std::move(*older);
  service_->set_ucx_port(ucx_->port(), /*appends=*/false);
  // The first calls on the old channels fail (their store went away); then they reconnect.
  const std::vector<uint8_t> row(4 * 128, 9);
  client_->AppendAsync(1, 0, 66, 1, row, row);
  (void)client_->Flush(absl::Now() + absl::Seconds(10));
  std::vector<uint8_t> k(4 * 128), v(4 * 128);
  (void)client_->GatherAsync({{1, 0, 1, {0, 0, 0, 0}, k.data(), v.data()}})
      ->Wait(absl::Now() + absl::Seconds(10));
  AppendThenReadBack(2, 300, 3);
  EXPECT_EQ(ucx_->append_batches(), 0);
}

// Append messages no worker sends get errors naming what is wrong, and the store serves on.
TEST(UcxDataPlane, MalformedAppendMessagesGetErrorsAndTheStoreServesOn) {
  setenv("UCX_NET_DEVICES", "lo", 0);
  auto store = StoreWithOneToken(1);
  KvStoreService service(*store);
  auto server = UcxDataServer::Start(
      *store, 0, [&service](std::span<const uint8_t> request, std::span<const uint8_t> rows) {
        return service.AppendBatchWithRows(request, rows);
      });
  ASSERT_TRUE(server.ok()) << server.status();
  RawUcxPeer peer((*server)->port());
  // The request's length is past the message.
  const std::vector<uint8_t> eight(8, 0);
  const absl::Status past = peer.Append({0, 9}, eight.data(), eight.size());
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
  // Bytes that are not an AppendBatchRequest.
  const std::vector<uint8_t> junk(64, 0xff);
  const absl::Status parse = peer.Append({0, junk.size()}, junk.data(), junk.size());
  EXPECT_EQ(parse.code(), absl::StatusCode::kInvalidArgument) << parse;
  // A request that names a staging file.
  pb::AppendBatchRequest named;
  named.set_staging_file("/dev/shm/infinigen-staging-1");
  const std::string named_bytes = named.SerializeAsString();
  const absl::Status staged =
      peer.Append({0, named_bytes.size()}, named_bytes.data(), named_bytes.size());
  EXPECT_EQ(staged.code(), absl::StatusCode::kInvalidArgument) << staged;
  // An append whose rows lie past the message: listed as that append's failure.
  pb::AppendBatchRequest outside;
  pb::AppendRequest* a = outside.add_appends();
  a->set_sequence_id(1);
  a->set_layer(0);
  a->set_start(1);
  a->set_num_tokens(1);
  a->set_staged_offset(16);
  a->set_staged_bytes(32);
  std::string message = outside.SerializeAsString();
  const size_t request_bytes = message.size();
  message.append(64, '\x01');  // 16 + 2 x 32 is past these 64
  ASSERT_TRUE(peer.Append({0, request_bytes}, message.data(), message.size()).ok());
  pb::AppendBatchResponse answer;
  ASSERT_TRUE(answer.ParseFromString(peer.answer()));
  EXPECT_EQ(answer.applied(), 0);
  ASSERT_EQ(answer.failures_size(), 1);
  EXPECT_EQ(answer.failures(0).code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(answer.failures(0).message().find("not inside the 64-byte message"), std::string::npos)
      << answer.failures(0).message();
  // Over the message limit: refused unread (nothing of it is allocated or received).
  std::unique_ptr<uint8_t[]> huge(new uint8_t[kMaxUcxAppendBytes + 1]);
  const absl::Status big = peer.Append({0, 0}, huge.get(), kMaxUcxAppendBytes + 1);
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted) << big;
  // The same rows inside the message are applied, through a worker's channel.
  auto channel = UcxDataChannel::Connect("127.0.0.1", (*server)->port());
  ASSERT_TRUE(channel.ok()) << channel.status();
  a->set_staged_offset(0);
  message = outside.SerializeAsString();
  const size_t fits = message.size();
  message.append(64, '\x01');
  auto applied = (*channel)->AppendBatch(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(message.data()), message.size()),
      fits, absl::Seconds(5));
  ASSERT_TRUE(applied.ok()) << applied.status();
  ASSERT_TRUE(answer.ParseFromString(*applied));
  EXPECT_EQ(answer.applied(), 1);
  EXPECT_EQ(answer.failures_size(), 0);
  EXPECT_EQ(store->Stats().tokens_stored, 2);
  EXPECT_EQ((*server)->append_batches(), 6);  // every message above answered
}

// A store started without an append handler refuses append messages with UNIMPLEMENTED (a
// worker never sends them one: the store's description says it takes none).
TEST(UcxDataPlane, AStoreWithoutAnAppendHandlerRefusesAppendMessages) {
  setenv("UCX_NET_DEVICES", "lo", 0);
  auto store = StoreWithOneToken(1);
  auto server = UcxDataServer::Start(*store, 0);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = UcxDataChannel::Connect("127.0.0.1", (*server)->port());
  ASSERT_TRUE(channel.ok()) << channel.status();
  const std::vector<uint8_t> message(8, 0);
  auto refused = (*channel)->AppendBatch(message, 8, absl::Seconds(5));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnimplemented) << refused.status();
}

}  // namespace
}  // namespace infinigen
