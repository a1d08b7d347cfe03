#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_store/ucx/ucx_common.h"
#include "kv_store/ucx/ucx_data_plane.h"
#include "kv_store/ucx/ucx_wire.h"

namespace infinigen {

struct UcxDataChannel::State {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  bool broken = false;
  uint64_t next_id = 1;

  // The gather in flight: where its stream goes (each item's K, then its V, in stream order).
  uint64_t waiting_for = 0;
  struct Region {
    size_t offset;  // in the stream
    uint8_t* dst;
    size_t length;
  };
  std::vector<Region> regions;
  size_t total = 0;
  // Messages of several small items land here, at their stream offset, and are copied out.
  std::vector<uint8_t> bounce;
  size_t arrived = 0;    // bytes in place
  bool replied = false;  // a piece or an error of this gather came back
  int32_t code = 0;
  std::string message;
  bool protocol_error = false;

  // Rendezvous pieces announced in the callback, received from the wait loop.
  struct Announced {
    void* desc;
    size_t offset, length;
    bool is_error;
  };
  std::vector<Announced> announced;
  std::vector<void*> stale;  // rendezvous pieces of gathers given up on: released unread
  struct Receive {
    State* st;
    size_t length;
    bool done = false;
    ucs_status_ptr_t request = nullptr;
    bool bounced = false;  // received into `bounce` at `offset`: scatter when done
    size_t offset = 0;
    void Done(ucs_status_t status) {
      done = true;
      if (status != UCS_OK) return;
      if (bounced && !st->Scatter(offset, length, st->bounce.data() + offset)) {
        st->protocol_error = true;
        return;
      }
      st->arrived += length;
    }
  };
  std::deque<Receive> receives;

  // Copies stream bytes [offset, offset + length) at src to their regions; false unless the
  // range is whole regions.
  bool Scatter(size_t offset, size_t length, const uint8_t* src) {
    auto it = std::lower_bound(regions.begin(), regions.end(), offset,
                               [](const Region& r, size_t o) { return r.offset < o; });
    size_t at = offset;
    for (; it != regions.end() && at < offset + length; ++it) {
      if (it->offset != at || at + it->length > offset + length) return false;
      std::memcpy(it->dst, src + (at - offset), it->length);
      at += it->length;
    }
    return at == offset + length;
  }
  // Where stream bytes [offset, offset + length) go: inside one region, else null.
  uint8_t* Place(size_t offset, size_t length) const {
    auto it = std::upper_bound(regions.begin(), regions.end(), offset,
                               [](size_t o, const Region& r) { return o < r.offset; });
    if (it == regions.begin()) return nullptr;
    const Region& r = *--it;
    if (offset + length > r.offset + r.length) return nullptr;
    return r.dst + (offset - r.offset);
  }

  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
    auto* st = static_cast<State*>(arg);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    ReplyHeader h;
    if (header_length != sizeof(h)) return UCS_OK;
    std::memcpy(&h, header, sizeof(h));
    if (h.id != st->waiting_for || st->waiting_for == 0) {  // a gather we gave up on
      if (!rndv) return UCS_OK;
      st->stale.push_back(data);
      return UCS_INPROGRESS;
    }
    st->replied = true;
    if (rndv) {
      st->announced.push_back({data, h.offset, length, h.code != 0});
      if (h.code != 0) st->code = h.code;
      return UCS_INPROGRESS;
    }
    const auto* p = static_cast<const uint8_t*>(data);
    if (h.code != 0) {
      st->code = h.code;
      st->message.assign(reinterpret_cast<const char*>(p), length);
      return UCS_OK;
    }
    if (length == 0) return UCS_OK;
    uint8_t* dst = st->Place(h.offset, length);
    if (dst != nullptr) {
      std::memcpy(dst, p, length);  // eager: copy out of UCX's buffer
    } else if (!st->Scatter(h.offset, length, p)) {
      st->protocol_error = true;
      return UCS_OK;
    }
    st->arrived += length;
    return UCS_OK;
  }

  // Posts the receive of an announced rendezvous piece straight into its destinations.
  void Post(const Announced& a) {
    if (a.is_error) {  // an error text sent by rendezvous (not expected, but possible)
      message.resize(a.length);
      Receive& r = receives.emplace_back(Receive{this, 0});
      r.request = RecvData(a.desc, message.data(), a.length, &r);
      return;
    }
    Receive& r = receives.emplace_back(Receive{this, a.length});
    uint8_t* dst = Place(a.offset, a.length);  // in place, in one piece
    if (dst == nullptr) {                      // several small items: into the bounce buffer
      if (a.offset + a.length > total) {
        receives.pop_back();
        protocol_error = true;
        ucp_am_data_release(worker, a.desc);
        return;
      }
      if (bounce.size() < total) bounce.resize(total);
      r.bounced = true;
      r.offset = a.offset;
      dst = bounce.data() + a.offset;
    }
    r.request = RecvData(a.desc, dst, a.length, &r);
  }
  ucs_status_ptr_t RecvData(void* desc, void* buffer, size_t length, Receive* r) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = [](void*, ucs_status_t status, size_t, void* user) {
      static_cast<Receive*>(user)->Done(status);
    };
    rp.user_data = r;
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(worker, desc, buffer, length, &rp);
    if (req == nullptr) {  // completed at once
      r->Done(UCS_OK);
    } else if (UCS_PTR_IS_ERR(req)) {
      r->done = true;
      protocol_error = true;
      return nullptr;
    }
    return req;
  }

  bool ReceivesPending() const {
    return std::any_of(receives.begin(), receives.end(), [](const Receive& r) { return !r.done; });
  }
  void FreeReceives() {
    for (Receive& r : receives) {
      if (r.request != nullptr && r.done) ucp_request_free(r.request);
    }
    receives.clear();
  }
  void ReleaseStale() {
    for (void* d : stale) ucp_am_data_release(worker, d);
    stale.clear();
  }

  // Closing the endpoint by force completes every request on it (the channel is then broken).
  void ForceClose() {
    if (ep != nullptr) CloseUcxEndpoint(worker, ep);
    ep = nullptr;
    broken = true;
  }
  // A send's buffer belongs to the caller: a send still running is cancelled, given a short
  // grace, then ended with the endpoint, and freed. ucp_request_cancel is asked first, but the
  // UCX sources we read cancel only tag receives: an active message's send or rendezvous receive
  // runs on until it completes.
  static constexpr absl::Duration kGrace = absl::Milliseconds(100);
  void FinishSend(ucs_status_ptr_t send) {
    if (send == nullptr || UCS_PTR_IS_ERR(send)) return;
    if (ucp_request_check_status(send) == UCS_INPROGRESS) ucp_request_cancel(worker, send);
    const absl::Time grace = absl::Now() + kGrace;
    while (ucp_request_check_status(send) == UCS_INPROGRESS && !broken && absl::Now() < grace) {
      ucp_worker_progress(worker);
    }
    if (ucp_request_check_status(send) == UCS_INPROGRESS) ForceClose();
    ucp_request_free(send);
  }

  // Sleeps until the worker has an event or about `cap` passed (the event fd of UCX's wakeup
  // feature). The append thread waits so: its calls run beside the step's compute, and a spin
  // would take one of the cores that compute needs (on 2 cores the decode steps slowed by
  // up to a third while appends spun for their answers). A gather spins while its bytes keep
  // coming and for kGatherSpin after the last event, then sleeps so, which bounds the CPU a
  // gather burns on a store that does not answer (frozen, or serving other workers' rows) to
  // about that. Not shorter: a decode step waits for its prefetch, and a thread that sleeps
  // loses its core to the step's compute; after 200 us a served worker's TPOT rose from 60 to
  // 98-108 ms (2K-token prompts, full reads over UCX, 2-core VM), at 5 ms it did not move.
  static constexpr absl::Duration kGatherSpin = absl::Milliseconds(5);
  int efd = -1;
  void SleepForEvent(absl::Duration cap) {
    if (efd < 0 || ucp_worker_arm(worker) != UCS_OK) return;  // BUSY: events are waiting
    pollfd pfd{efd, POLLIN, 0};
    ::poll(&pfd, 1, static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(cap), 1, 50)));
  }

  // The append batch in flight and its answer (a channel of the append thread's own).
  uint64_t waiting_append = 0;
  bool append_answered = false;
  int32_t append_code = 0;
  std::string append_answer;

  static ucs_status_t OnAppendReply(void* arg, const void* header, size_t header_length, void* data,
                                    size_t length, const ucp_am_recv_param_t* param) {
    auto* st = static_cast<State*>(arg);
    ReplyHeader h;
    if (header_length != sizeof(h)) return UCS_OK;
    std::memcpy(&h, header, sizeof(h));
    // One given up on is dropped (by rendezvous: released unread).
    if (h.id != st->waiting_append || st->waiting_append == 0) return UCS_OK;
    st->append_answered = true;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {  // the store sends answers eagerly
      st->append_code = static_cast<int32_t>(absl::StatusCode::kInternal);
      st->append_answer = "the KV store's append answer did not come as one eager message";
      return UCS_OK;
    }
    st->append_code = h.code;
    st->append_answer.assign(static_cast<const char*>(data), length);
    return UCS_OK;
  }
};

absl::StatusOr<std::unique_ptr<UcxDataChannel>> UcxDataChannel::Connect(const std::string& host,
                                                                        int port) {
  std::unique_ptr<UcxDataChannel> c(new UcxDataChannel());
  c->state_ = std::make_unique<State>();
  State& st = *c->state_;
  if (auto s = InitUcxWorker(&st.context, &st.worker); !s.ok()) return s;
  IG_RETURN_IF_ERROR(SetUcxAmHandler(st.worker, kGatherReply, State::OnReply, &st));
  IG_RETURN_IF_ERROR(SetUcxAmHandler(st.worker, kAppendReply, State::OnAppendReply, &st));
  if (ucp_worker_get_efd(st.worker, &st.efd) != UCS_OK) st.efd = -1;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) {
    static_cast<State*>(arg)->broken = true;
  };
  ep.err_handler.arg = &st;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve KV store host ", host));
  }
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ep.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  ep.sockaddr.addrlen = sizeof(addr);
  ucs_status_t s = ucp_ep_create(st.worker, &ep, &st.ep);
  if (s != UCS_OK) return UcsError("connect", s);
  // Finish the connection here (a flush waits for the wire-up), not in the first gather: a
  // worker taking a stream over after a failover would pay it then (650 ms measured on
  // loopback TCP against 170 ms for the whole first request).
  ucp_request_param_t fp{};
  ucs_status_ptr_t flush = ucp_ep_flush_nbx(st.ep, &fp);
  if (UCS_PTR_IS_ERR(flush)) return UcsError("connect", UCS_PTR_STATUS(flush));
  if (flush != nullptr) {
    const absl::Time end = absl::Now() + absl::Seconds(5);
    while (ucp_request_check_status(flush) == UCS_INPROGRESS && absl::Now() < end) {
      ucp_worker_progress(st.worker);
    }
    const ucs_status_t fs = ucp_request_check_status(flush);
    if (fs == UCS_INPROGRESS) {
      ucp_request_cancel(st.worker, flush);
      while (ucp_request_check_status(flush) == UCS_INPROGRESS) ucp_worker_progress(st.worker);
    }
    ucp_request_free(flush);
    if (fs != UCS_OK) return UcsError("connect", fs == UCS_INPROGRESS ? UCS_ERR_TIMED_OUT : fs);
  }
  return c;
}

UcxDataChannel::~UcxDataChannel() {
  if (state_ == nullptr) return;
  State& st = *state_;
  st.ReleaseStale();
  if (st.ep != nullptr) CloseUcxEndpoint(st.worker, st.ep);
  if (st.worker != nullptr) ucp_worker_destroy(st.worker);
  if (st.context != nullptr) ucp_cleanup(st.context);
}

bool UcxDataChannel::broken() const { return state_->broken; }

absl::Status UcxDataChannel::Gather(const std::vector<ClientGatherItem>& items,
                                    const std::vector<int64_t>& row_bytes, absl::Duration timeout) {
  State& st = *state_;
  if (st.broken) return absl::UnavailableError("the UCX connection to the KV store broke");
  std::vector<uint8_t> request;
  PutItemCount(request, static_cast<uint32_t>(items.size()));
  st.regions.clear();
  st.total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& it = items[i];
    PutGatherItem(request, it.seq, it.layer, it.count, it.slots);
    if (it.count <= 0) continue;
    // K of every head, then V of every head: where the item's buffers want them.
    const size_t half = it.slots.size() * static_cast<size_t>(row_bytes[i]);
    st.regions.push_back({st.total, it.k_out, half});
    st.regions.push_back({st.total + half, it.v_out, half});
    st.total += 2 * half;
  }
  // The store gathers and sends each item whole (its K and its V, two messages): over TCP every
  // extra message costs more than overlapping the gather with the transfer saves (a 1 MiB gather
  // in pieces of 64 KiB / 256 KiB / whole: p50 640 / 550 / 340 us). The store still honours
  // smaller pieces, for fabrics faster than its gather.
  const uint64_t piece = std::clamp<uint64_t>(st.total, kMinPiece, kMaxPiece);
  RequestHeader header{st.next_id++, piece};
  st.waiting_for = header.id;
  st.arrived = 0;
  st.replied = false;
  st.code = 0;
  st.message.clear();
  st.protocol_error = false;
  for (const auto& a : st.announced) st.stale.push_back(a.desc);  // none expected: never unread
  st.announced.clear();
  st.ReleaseStale();
  const absl::Time deadline = absl::Now() + timeout;
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Eager: the store reads requests in its receive callback, which only sees eager payloads.
  rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t send = ucp_am_send_nbx(st.ep, kGatherRequest, &header, sizeof(header),
                                          request.data(), request.size(), &rp);
  if (UCS_PTR_IS_ERR(send)) return UcsError("send", UCS_PTR_STATUS(send));

  absl::Status status;
  // An error reply may arrive before pieces already announced: wait for what was posted.
  auto finished = [&] {
    const bool sent = send == nullptr || ucp_request_check_status(send) != UCS_INPROGRESS;
    if (!sent || !st.replied || !st.announced.empty() || st.ReceivesPending()) return false;
    return st.code != 0 || st.protocol_error || st.arrived == st.total;
  };
  absl::Time last_event = absl::Now();
  while (!finished()) {
    if (st.broken) {
      status = absl::UnavailableError("the UCX connection to the KV store broke");
      break;
    }
    const unsigned progressed = ucp_worker_progress(st.worker);
    st.ReleaseStale();
    for (const auto& a : st.announced) st.Post(a);
    st.announced.clear();
    if (progressed != 0) {
      last_event = absl::Now();
      continue;
    }
    const absl::Time now = absl::Now();
    if (now > deadline) {
      status = absl::DeadlineExceededError("UCX gather did not finish before its deadline");
      break;
    }
    if (now - last_event > State::kGatherSpin) st.SleepForEvent(deadline - now);
  }
  // Pieces of a failed gather that still come are released unread from here on (OnReply files
  // them as stale), not announced and forgotten: an unreleased rendezvous piece would keep the
  // store's send, and its reply buffer, pending for the connection's life.
  if (!status.ok()) st.waiting_for = 0;
  st.FinishSend(send);  // the request's bytes are ours
  if (!status.ok()) {
    // The destinations belong to the caller: receives already posted may still write them, so
    // they finish (within the grace) or are ended with the endpoint before this returns.
    for (const auto& a : st.announced) st.stale.push_back(a.desc);
    st.announced.clear();
    for (auto& r : st.receives) {
      if (!r.done && r.request != nullptr) ucp_request_cancel(st.worker, r.request);
    }
    for (int attempt = 0; attempt < 2 && st.ReceivesPending(); ++attempt) {
      if (attempt == 1) st.ForceClose();
      const absl::Time cap = absl::Now() + (attempt == 0 ? State::kGrace : absl::Seconds(2));
      while (st.ReceivesPending() && absl::Now() < cap) ucp_worker_progress(st.worker);
    }
    if (st.ReceivesPending()) st.broken = true;
    st.ReleaseStale();
  }
  if (!st.ReceivesPending()) st.FreeReceives();
  st.waiting_for = 0;
  if (!status.ok()) return status;
  if (st.code != 0) return absl::Status(static_cast<absl::StatusCode>(st.code), st.message);
  if (st.protocol_error) {
    st.broken = true;
    return absl::InternalError("the UCX gather reply did not match the request");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> UcxDataChannel::AppendBatch(std::span<const uint8_t> message,
                                                        size_t request_bytes,
                                                        absl::Duration timeout) {
  State& st = *state_;
  if (st.broken) return absl::UnavailableError("the UCX connection to the KV store broke");
  if (message.size() > kMaxUcxAppendBytes || request_bytes > message.size()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "an append message of ", message.size(), " bytes is over the ", kMaxUcxAppendBytes,
        "-byte limit (or shorter than its request): send fewer ", "rows per batch"));
  }
  AppendHeader header{st.next_id++, request_bytes};
  st.waiting_append = header.id;
  st.append_answered = false;
  st.append_code = 0;
  st.append_answer.clear();
  const absl::Time deadline = absl::Now() + timeout;
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_REPLY;  // a large batch goes by rendezvous, read in place
  ucs_status_ptr_t send = ucp_am_send_nbx(st.ep, kAppendRequest, &header, sizeof(header),
                                          message.data(), message.size(), &rp);
  if (UCS_PTR_IS_ERR(send)) {
    st.waiting_append = 0;
    return UcsError("send", UCS_PTR_STATUS(send));
  }
  absl::Status status;
  for (;;) {
    const ucs_status_t sent = send == nullptr ? UCS_OK : ucp_request_check_status(send);
    if (sent != UCS_OK && sent != UCS_INPROGRESS) {
      status = UcsError("append send", sent);
      break;
    }
    if (sent == UCS_OK && st.append_answered) break;
    if (st.broken) {
      status = absl::UnavailableError("the UCX connection to the KV store broke");
      break;
    }
    if (ucp_worker_progress(st.worker) != 0) continue;
    const absl::Time now = absl::Now();
    if (now > deadline) {
      status = absl::DeadlineExceededError("UCX append batch was not answered before its deadline");
      break;
    }
    st.SleepForEvent(deadline - now);
  }
  st.FinishSend(send);
  st.waiting_append = 0;
  if (!status.ok()) return status;
  if (st.append_code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(st.append_code), st.append_answer);
  }
  return std::move(st.append_answer);
}

}  // namespace infinigen
