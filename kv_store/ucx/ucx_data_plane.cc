#include "kv_store/ucx/ucx_data_plane.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <ucp/api/ucp.h>

#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace infinigen {
namespace {

constexpr unsigned kGatherRequest = 1;
constexpr unsigned kGatherReply = 2;

struct RequestHeader {
  uint64_t id;
};
struct ReplyHeader {
  uint64_t id;
  int32_t code;  // absl::StatusCode; 0 = rows follow, else the error message follows
};

absl::Status UcsError(const char* what, ucs_status_t s) {
  return absl::UnavailableError(absl::StrCat("UCX ", what, ": ", ucs_status_string(s)));
}

// A ucp context and worker with active messages and wakeup support.
absl::Status InitWorker(ucp_context_h* context, ucp_worker_h* worker) {
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcsError("config", s);
  s = ucp_init(&params, config, context);
  ucp_config_release(config);
  if (s != UCS_OK) return UcsError("init", s);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(*context, &wp, worker);
  if (s != UCS_OK) {
    ucp_cleanup(*context);
    return UcsError("worker", s);
  }
  return absl::OkStatus();
}

// Serialized request: u32 items, then per item u64 seq, i32 layer, i64 count, i64 n, n x i32.
template <typename T>
void Put(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}
template <typename T>
bool Take(const uint8_t*& p, const uint8_t* end, T* v) {
  if (static_cast<size_t>(end - p) < sizeof(T)) return false;
  std::memcpy(v, p, sizeof(T));
  p += sizeof(T);
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------- server

struct UcxGatherServer::State {
  KvStore* store = nullptr;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  std::vector<ucp_ep_h> endpoints;  // progress thread only
  std::atomic<bool> stop{false};
  std::thread progress;

  static void OnConnection(ucp_conn_request_h request, void* arg) {
    auto* st = static_cast<State*>(arg);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.conn_request = request;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};  // a worker went away
    ep.err_handler.arg = nullptr;
    ucp_ep_h handle;
    if (ucp_ep_create(st->worker, &ep, &handle) == UCS_OK) st->endpoints.push_back(handle);
  }

  // A reply in flight: UCX reads the header and the data until the send completes.
  struct Outgoing {
    ReplyHeader header;
    std::vector<uint8_t> data;
  };

  static void OnSent(void* request, ucs_status_t, void* user_data) {
    delete static_cast<Outgoing*>(user_data);
    ucp_request_free(request);
  }

  void Reply(ucp_ep_h ep, uint64_t id, const absl::Status& status, Outgoing* out) {
    out->header = {id, static_cast<int32_t>(status.code())};
    if (!status.ok()) out->data.assign(status.message().begin(), status.message().end());
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = OnSent;
    rp.user_data = out;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, kGatherReply, &out->header, sizeof(out->header),
                                         out->data.data(), out->data.size(), &rp);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) delete out;  // done at once, or failed
  }

  static ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
    auto* st = static_cast<State*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        header_length != sizeof(RequestHeader)) {
      return UCS_OK;  // nobody to answer
    }
    RequestHeader h;
    std::memcpy(&h, header, sizeof(h));
    auto* reply = new Outgoing();
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      st->Reply(param->reply_ep, h.id,
                absl::InvalidArgumentError("gather request too large for one message"), reply);
      return UCS_OK;
    }
    const absl::Status served = st->Serve(static_cast<const uint8_t*>(data), length, reply->data);
    st->Reply(param->reply_ep, h.id, served, reply);
    return UCS_OK;
  }

  // Parses a request and gathers its rows into `out` (K then V per item).
  absl::Status Serve(const uint8_t* p, size_t length, std::vector<uint8_t>& out) {
    const uint8_t* end = p + length;
    uint32_t n;
    if (!Take(p, end, &n)) return absl::InvalidArgumentError("malformed gather request");
    std::vector<std::vector<int32_t>> slots(n);
    std::vector<GatherItem> items(n);
    std::vector<int64_t> offsets(n);
    size_t total = 0;
    for (uint32_t i = 0; i < n; ++i) {
      int64_t count, num;
      int32_t layer;
      uint64_t seq;
      if (!Take(p, end, &seq) || !Take(p, end, &layer) || !Take(p, end, &count) ||
          !Take(p, end, &num) || num < 0 || static_cast<size_t>(end - p) < num * sizeof(int32_t)) {
        return absl::InvalidArgumentError("malformed gather request");
      }
      slots[i].resize(num);
      std::memcpy(slots[i].data(), p, num * sizeof(int32_t));
      p += num * sizeof(int32_t);
      auto spec = store->Spec(seq);
      if (!spec.ok()) return spec.status();
      items[i] = {seq, layer, count, slots[i], nullptr, nullptr};
      offsets[i] = static_cast<int64_t>(total);
      total += 2 * num * spec->row_bytes();
    }
    out.resize(total);
    for (uint32_t i = 0; i < n; ++i) {
      const size_t half = (i + 1 < n ? offsets[i + 1] : total) - offsets[i];
      items[i].k_out = out.data() + offsets[i];
      items[i].v_out = out.data() + offsets[i] + half / 2;
    }
    return store->Gather(items);
  }

  void Loop() {
    const int fd = [&] {
      int efd = -1;
      ucp_worker_get_efd(worker, &efd);
      return efd;
    }();
    while (!stop.load()) {
      if (ucp_worker_progress(worker) != 0) continue;
      if (fd >= 0 && ucp_worker_arm(worker) == UCS_OK) {
        pollfd pfd{fd, POLLIN, 0};
        ::poll(&pfd, 1, 50);
      }
    }
  }
};

absl::StatusOr<std::unique_ptr<UcxGatherServer>> UcxGatherServer::Start(KvStore& store, int port) {
  std::unique_ptr<UcxGatherServer> server(new UcxGatherServer());
  server->state_ = std::make_unique<State>();
  State& st = *server->state_;
  st.store = &store;
  if (auto s = InitWorker(&st.context, &st.worker); !s.ok()) return s;
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kGatherRequest;
  hp.cb = State::OnRequest;
  hp.arg = &st;
  ucs_status_t s = ucp_worker_set_am_recv_handler(st.worker, &hp);
  if (s != UCS_OK) return UcsError("AM handler", s);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  lp.sockaddr.addrlen = sizeof(addr);
  lp.conn_handler.cb = State::OnConnection;
  lp.conn_handler.arg = &st;
  s = ucp_listener_create(st.worker, &lp, &st.listener);
  if (s != UCS_OK) return UcsError(absl::StrCat("listen on port ", port).c_str(), s);
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (ucp_listener_query(st.listener, &attr) == UCS_OK) {
    server->port_ = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  }
  st.progress = std::thread([&st] { st.Loop(); });
  return server;
}

UcxGatherServer::~UcxGatherServer() {
  if (state_ == nullptr) return;
  State& st = *state_;
  st.stop.store(true);
  if (st.progress.joinable()) st.progress.join();
  if (st.listener != nullptr) ucp_listener_destroy(st.listener);
  for (ucp_ep_h ep : st.endpoints) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &rp);
    while (r != nullptr && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS) {
      ucp_worker_progress(st.worker);
    }
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
  }
  if (st.worker != nullptr) ucp_worker_destroy(st.worker);
  if (st.context != nullptr) ucp_cleanup(st.context);
}

// ---------------------------------------------------------------------------------- client

struct UcxGatherChannel::State {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  bool broken = false;
  // The reply to the request in flight.
  uint64_t waiting_for = 0;
  bool replied = false;
  int32_t code = 0;
  std::vector<uint8_t> data;
  void* rndv_desc = nullptr;
  size_t rndv_length = 0;
  uint64_t next_id = 1;

  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
    auto* st = static_cast<State*>(arg);
    ReplyHeader h;
    if (header_length != sizeof(h)) return UCS_OK;
    std::memcpy(&h, header, sizeof(h));
    if (h.id != st->waiting_for) return UCS_OK;  // a reply to a request we gave up on
    st->code = h.code;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      st->rndv_desc = data;  // received later, outside the callback, into our buffer
      st->rndv_length = length;
      st->replied = true;
      return UCS_INPROGRESS;
    }
    st->data.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + length);
    st->replied = true;
    return UCS_OK;
  }
};

absl::StatusOr<std::unique_ptr<UcxGatherChannel>> UcxGatherChannel::Connect(const std::string& host,
                                                                            int port) {
  std::unique_ptr<UcxGatherChannel> c(new UcxGatherChannel());
  c->state_ = std::make_unique<State>();
  State& st = *c->state_;
  if (auto s = InitWorker(&st.context, &st.worker); !s.ok()) return s;
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kGatherReply;
  hp.cb = State::OnReply;
  hp.arg = &st;
  ucs_status_t s = ucp_worker_set_am_recv_handler(st.worker, &hp);
  if (s != UCS_OK) return UcsError("AM handler", s);
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve KV store host ", host));
  }
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  ep.sockaddr.addrlen = sizeof(addr);
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) {
    static_cast<State*>(arg)->broken = true;
  };
  ep.err_handler.arg = &st;
  s = ucp_ep_create(st.worker, &ep, &st.ep);
  if (s != UCS_OK) return UcsError("connect", s);
  return c;
}

UcxGatherChannel::~UcxGatherChannel() {
  if (state_ == nullptr) return;
  State& st = *state_;
  if (st.ep != nullptr) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(st.ep, &rp);
    while (r != nullptr && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS) {
      ucp_worker_progress(st.worker);
    }
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
  }
  if (st.worker != nullptr) ucp_worker_destroy(st.worker);
  if (st.context != nullptr) ucp_cleanup(st.context);
}

absl::Status UcxGatherChannel::Gather(const std::vector<ClientGatherItem>& items,
                                      const std::vector<int64_t>& row_bytes,
                                      absl::Duration timeout) {
  State& st = *state_;
  if (st.broken) return absl::UnavailableError("the UCX connection to the KV store broke");
  std::vector<uint8_t> request;
  Put<uint32_t>(request, static_cast<uint32_t>(items.size()));
  for (const auto& it : items) {
    Put<uint64_t>(request, it.seq);
    Put<int32_t>(request, it.layer);
    Put<int64_t>(request, it.count);
    Put<int64_t>(request, static_cast<int64_t>(it.slots.size()));
    const auto* p = reinterpret_cast<const uint8_t*>(it.slots.data());
    request.insert(request.end(), p, p + it.slots.size() * sizeof(int32_t));
  }
  RequestHeader header{st.next_id++};
  st.waiting_for = header.id;
  st.replied = false;
  st.rndv_desc = nullptr;
  const absl::Time deadline = absl::Now() + timeout;
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Eager: the store answers from its receive callback, which only sees eager payloads.
  rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t send = ucp_am_send_nbx(st.ep, kGatherRequest, &header, sizeof(header),
                                          request.data(), request.size(), &rp);
  if (UCS_PTR_IS_ERR(send)) return UcsError("send", UCS_PTR_STATUS(send));
  auto wait = [&](auto done) -> absl::Status {
    while (!done()) {
      if (st.broken) return absl::UnavailableError("the UCX connection to the KV store broke");
      if (ucp_worker_progress(st.worker) == 0 && absl::Now() > deadline) {
        return absl::DeadlineExceededError("UCX gather did not finish before its deadline");
      }
    }
    return absl::OkStatus();
  };
  absl::Status status = wait([&] {
    return (send == nullptr || ucp_request_check_status(send) != UCS_INPROGRESS) && st.replied;
  });
  if (send != nullptr) {
    if (status.ok() || ucp_request_check_status(send) != UCS_INPROGRESS) ucp_request_free(send);
  }
  if (!status.ok()) {
    st.waiting_for = 0;
    return status;
  }
  if (st.rndv_desc != nullptr) {
    st.data.resize(st.rndv_length);
    bool received = false;
    ucp_request_param_t rr{};
    rr.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rr.cb.recv_am = [](void*, ucs_status_t, size_t, void* user) {
      *static_cast<bool*>(user) = true;
    };
    rr.user_data = &received;
    ucs_status_ptr_t r =
        ucp_am_recv_data_nbx(st.worker, st.rndv_desc, st.data.data(), st.data.size(), &rr);
    if (UCS_PTR_IS_ERR(r)) return UcsError("receive", UCS_PTR_STATUS(r));
    if (r != nullptr) {
      status = wait([&] { return received; });
      if (!status.ok()) return status;  // the request stays owned by UCX until it completes
      ucp_request_free(r);
    }
  }
  st.waiting_for = 0;
  if (st.code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(st.code),
                        std::string(st.data.begin(), st.data.end()));
  }
  size_t offset = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t half = items[i].slots.size() * static_cast<size_t>(row_bytes[i]);
    if (offset + 2 * half > st.data.size()) return absl::InternalError("short UCX gather reply");
    std::memcpy(items[i].k_out, st.data.data() + offset, half);
    std::memcpy(items[i].v_out, st.data.data() + offset + half, half);
    offset += 2 * half;
  }
  return absl::OkStatus();
}

}  // namespace infinigen
