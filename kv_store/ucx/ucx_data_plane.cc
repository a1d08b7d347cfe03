#include "kv_store/ucx/ucx_data_plane.h"

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
#include "kv_store/ucx/gather_wire.h"

namespace infinigen {
namespace {

constexpr uint64_t kMinPiece = 64 << 10, kMaxPiece = 64 << 20;
// Items whose K rows (and V rows) are smaller than this travel several to a message (of up to
// kGroupBytes), which the worker receives into one buffer and copies out: two messages for every
// small item of a batch cost more than that copy (16 items, 0.5-4 MiB in all, over TCP:
// 1.1-2.4x slower than grouped).
constexpr size_t kSmallItem = 256 << 10, kGroupBytes = 1 << 20;

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

void CloseEndpoint(ucp_worker_h worker, ucp_ep_h ep) {
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &rp);
  while (r != nullptr && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS) {
    ucp_worker_progress(worker);
  }
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
}

}  // namespace

// ---------------------------------------------------------------------------------- server

struct UcxGatherServer::State {
  KvStore* store = nullptr;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  std::vector<ucp_ep_h> endpoints;  // progress thread only
  std::vector<ucp_ep_h> failed;     // endpoints whose worker went away: closed by the loop
  std::atomic<int> connected{0};    // endpoints.size(), for readers off the progress thread
  std::atomic<bool> stop{false};
  std::thread progress;

  static void OnConnection(ucp_conn_request_h request, void* arg) {
    auto* st = static_cast<State*>(arg);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.conn_request = request;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h failed_ep, ucs_status_t) {  // a worker went away
      static_cast<State*>(arg)->failed.push_back(failed_ep);
    };
    ep.err_handler.arg = st;
    ucp_ep_h handle;
    if (ucp_ep_create(st->worker, &ep, &handle) == UCS_OK) {
      st->endpoints.push_back(handle);
      st->connected.store(static_cast<int>(st->endpoints.size()));
    }
  }

  // A reply buffer: registered with UCX once and reused (no page faults or registration per
  // gather). It goes back to the idle list when every piece sent from it has completed.
  struct Buffer {
    State* owner = nullptr;
    uint8_t* data = nullptr;
    size_t capacity = 0;
    ucp_mem_h memh = nullptr;
    int sends = 0;        // pieces in flight
    bool filling = true;  // more pieces may still be sent from it
    std::deque<ReplyHeader> piece_headers;
    std::string error;
  };
  std::vector<Buffer*> idle;  // progress thread only

  // A gather being answered, a few KV heads at a time, between progress calls.
  struct Job {
    ucp_ep_h ep;
    uint64_t id;
    uint64_t piece_bytes;
    std::vector<std::vector<int32_t>> slots;  // per item
    std::vector<GatherItem> units;            // one per (item, KV head), in order
    struct Place {
      size_t item;
      size_t k, v;      // stream offsets of the unit's K and V rows
      size_t half;      // bytes of each
      size_t item_end;  // stream offset where the unit's item ends
      bool small;       // the item's K rows are fewer than kSmallItem bytes
    };
    std::vector<Place> places;  // per unit
    size_t total = 0;
    size_t next_unit = 0;
    Buffer* buffer = nullptr;
  };
  std::deque<Job> jobs;

  Buffer* Acquire(size_t bytes) {
    for (size_t i = 0; i < idle.size(); ++i) {
      if (idle[i]->capacity >= bytes) {
        Buffer* b = idle[i];
        idle.erase(idle.begin() + static_cast<std::ptrdiff_t>(i));
        b->filling = true;
        b->piece_headers.clear();
        return b;
      }
    }
    if (!idle.empty()) {  // all too small: drop the oldest
      Free(idle.front());
      idle.erase(idle.begin());
    }
    auto* b = new Buffer();
    b->owner = this;
    b->capacity = std::max<size_t>(bytes, 64 << 10);
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.length = b->capacity;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    if (ucp_mem_map(context, &mp, &b->memh) == UCS_OK) {
      ucp_mem_attr_t attr{};
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
      ucp_mem_query(b->memh, &attr);
      b->data = static_cast<uint8_t*>(attr.address);
    } else {
      b->memh = nullptr;
      b->data = static_cast<uint8_t*>(std::malloc(b->capacity));
    }
    return b;
  }
  void MaybeRelease(Buffer* b) {
    if (b->filling || b->sends > 0) return;
    if (idle.size() >= 4) {
      Free(b);
    } else {
      idle.push_back(b);
    }
  }
  void Free(Buffer* b) {
    if (b->memh != nullptr) {
      ucp_mem_unmap(context, b->memh);
    } else {
      std::free(b->data);
    }
    delete b;
  }

  static void OnSent(void* request, ucs_status_t, void* user_data) {
    auto* b = static_cast<Buffer*>(user_data);
    --b->sends;
    b->owner->MaybeRelease(b);
    ucp_request_free(request);
  }

  // Sends `length` bytes at `payload` (inside b, or b's error text) under `header`.
  void Send(ucp_ep_h ep, Buffer* b, const ReplyHeader& header, const void* payload, size_t length,
            bool registered) {
    b->piece_headers.push_back(header);  // UCX reads the header until the send completes
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    if (registered && b->memh != nullptr) {
      rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      rp.memh = b->memh;
    }
    rp.cb.send = OnSent;
    rp.user_data = b;
    ++b->sends;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, kGatherReply, &b->piece_headers.back(),
                                         sizeof(ReplyHeader), payload, length, &rp);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) --b->sends;  // done at once, or failed
  }

  void Fail(ucp_ep_h ep, uint64_t id, const absl::Status& status, Buffer* b) {
    b->error = std::string(status.message());
    Send(ep, b, {id, static_cast<int32_t>(status.code()), 0, 0}, b->error.data(), b->error.size(),
         /*registered=*/false);
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
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      Buffer* b = st->Acquire(0);
      st->Fail(param->reply_ep, h.id,
               absl::InvalidArgumentError("gather request too large for one message"), b);
      b->filling = false;
      st->MaybeRelease(b);
      return UCS_OK;
    }
    Job job;
    job.ep = param->reply_ep;
    job.id = h.id;
    job.piece_bytes = std::clamp<uint64_t>(h.piece_bytes, kMinPiece, kMaxPiece);
    const absl::Status parsed = st->Parse(static_cast<const uint8_t*>(data), length, job);
    if (!parsed.ok()) {
      Buffer* b = st->Acquire(0);
      st->Fail(job.ep, job.id, parsed, b);
      b->filling = false;
      st->MaybeRelease(b);
      return UCS_OK;
    }
    // A channel has one gather in flight: a new request from it means it gave up on the ones
    // still queued, which would only delay this one.
    st->DropJobs(job.ep);
    st->jobs.push_back(std::move(job));  // answered from the loop, between progress calls
    return UCS_OK;
  }

  // Reads a request into a job: its units in stream order. Lengths come from the network:
  // nothing is sized from them before they are checked (gather_wire.h, CountMatches).
  absl::Status Parse(const uint8_t* p, size_t length, Job& job) {
    IG_ASSIGN_OR_RETURN(std::vector<WireGatherItem> items, ParseGatherRequest(p, length));
    job.slots.resize(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      const WireGatherItem& it = items[i];
      job.slots[i] = std::move(items[i].slots);
      auto spec = store->Spec(it.seq);
      if (!spec.ok()) return spec.status();
      const int64_t heads = spec->num_kv_heads;
      if (!CountMatches(it.count, heads, job.slots[i].size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", it.seq, " layer ", it.layer, ": ", job.slots[i].size(),
                         " indices given for ", it.count, " rows x ", heads, " KV heads"));
      }
      if (it.count == 0) continue;
      const size_t half = static_cast<size_t>(it.count * spec->row_bytes());
      for (int g = 0; g < heads; ++g) {
        GatherItem u{
            it.seq,   it.layer,
            it.count, std::span<const int32_t>(job.slots[i]).subspan(g * it.count, it.count),
            nullptr,  nullptr,
            g,        1};
        u.row_bytes = spec->row_bytes();  // what the reply buffer is sized for
        job.units.push_back(u);
        job.places.push_back({i, job.total + g * half, job.total + (heads + g) * half, half,
                              job.total + 2 * static_cast<size_t>(heads) * half,
                              heads * half < kSmallItem});
      }
      job.total += 2 * static_cast<size_t>(heads) * half;
    }
    return absl::OkStatus();
  }

  // Gathers the next few KV heads of one item of the first job and sends their K and their V;
  // drops the job after its last heads.
  void Advance() {
    Job& job = jobs.front();
    if (job.buffer == nullptr) job.buffer = Acquire(job.total);
    Buffer* b = job.buffer;
    const size_t first = job.next_unit;
    const bool group = first < job.units.size() && job.places[first].small;
    size_t last = first, bytes = 0;
    // A large item: a few of its heads at a time. Small items: whole, several together.
    auto takes = [&](size_t u) {
      if (u == first) return true;
      const Job::Place& p = job.places[u];
      if (!group) return p.item == job.places[first].item && bytes < job.piece_bytes;
      return p.small && (p.item == job.places[u - 1].item || bytes < kGroupBytes);
    };
    while (last < job.units.size() && takes(last)) {
      job.units[last].k_out = b->data + job.places[last].k;
      job.units[last].v_out = b->data + job.places[last].v;
      bytes += 2 * job.places[last].half;
      ++last;
    }
    const bool final_piece = last == job.units.size();
    absl::Status status = absl::OkStatus();
    if (last > first) {
      status = store->Gather(std::span<const GatherItem>(job.units).subspan(first, last - first),
                             final_piece ? 0 : 1);
    }
    if (!status.ok()) {
      Fail(job.ep, job.id, status, b);
    } else if (last > first && group) {  // whole small items: one message
      Send(job.ep, b, {job.id, 0, 0, job.places[first].k}, b->data + job.places[first].k, bytes,
           /*registered=*/true);
    } else if (last > first) {
      for (size_t offset : {job.places[first].k, job.places[first].v}) {  // each contiguous
        Send(job.ep, b, {job.id, 0, 0, offset}, b->data + offset, bytes / 2, /*registered=*/true);
      }
    } else {  // nothing to gather: one empty piece says so
      Send(job.ep, b, {job.id, 0, 0, 0}, b->data, 0, /*registered=*/true);
    }
    job.next_unit = last;
    if (final_piece || !status.ok()) {
      b->filling = false;
      MaybeRelease(b);
      jobs.pop_front();
    } else if (jobs.size() > 1) {  // other workers' gathers take turns with this one's items
      jobs.push_back(std::move(jobs.front()));
      jobs.pop_front();
    }
  }

  // Forgets the queued gathers of `ep`; a partly sent one's buffer goes back once its sends
  // finish.
  void DropJobs(ucp_ep_h ep) {
    for (auto it = jobs.begin(); it != jobs.end();) {
      if (it->ep != ep) {
        ++it;
        continue;
      }
      if (it->buffer != nullptr) {
        it->buffer->filling = false;
        MaybeRelease(it->buffer);
      }
      it = jobs.erase(it);
    }
  }

  // Closes the endpoints of workers that went away (a crash, or a channel the worker dropped to
  // reconnect) and forgets their queued gathers; without this every reconnect kept a socket
  // and its UCX resources until the store stopped.
  void DropFailed() {
    std::vector<ucp_ep_h> gone;
    gone.swap(failed);
    for (ucp_ep_h ep : gone) {
      DropJobs(ep);
      auto at = std::find(endpoints.begin(), endpoints.end(), ep);
      if (at == endpoints.end()) continue;  // reported twice
      endpoints.erase(at);
      CloseEndpoint(worker, ep);
    }
    connected.store(static_cast<int>(endpoints.size()));
  }

  // Polls without sleeping for this long after the last event: a worker's gathers come a layer
  // apart (well under a millisecond on a GPU), and waking from poll costs tens of microseconds
  // per gather on a VM (0.5 MiB over TCP: 215 -> 176 us p50 with the spin).
  static constexpr std::chrono::microseconds kSpinAfterActivity{1000};
  std::chrono::steady_clock::time_point last_activity;

  void Loop() {
    const int fd = [&] {
      int efd = -1;
      ucp_worker_get_efd(worker, &efd);
      return efd;
    }();
    while (!stop.load()) {
      const unsigned progressed = ucp_worker_progress(worker);
      if (!failed.empty()) DropFailed();
      if (!jobs.empty()) {
        Advance();
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      if (progressed != 0) {
        last_activity = now;
        continue;
      }
      if (now - last_activity < kSpinAfterActivity) continue;  // the next layer's gather is near
      if (fd >= 0 && ucp_worker_arm(worker) == UCS_OK) {
        pollfd pfd{fd, POLLIN, 0};
        ::poll(&pfd, 1, 50);
      }
    }
  }
};

absl::StatusOr<std::unique_ptr<UcxGatherServer>> UcxGatherServer::Start(KvStore& store, int port) {
  // A restarted store must get its port back while the old connections sit in TIME_WAIT (UCX
  // does not set SO_REUSEADDR by default). The environment still wins when it says otherwise.
  ::setenv("UCX_TCP_CM_REUSEADDR", "y", /*overwrite=*/0);
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

int UcxGatherServer::connected_workers() const { return state_->connected.load(); }

UcxGatherServer::~UcxGatherServer() {
  if (state_ == nullptr) return;
  State& st = *state_;
  st.stop.store(true);
  if (st.progress.joinable()) st.progress.join();
  if (st.listener != nullptr) ucp_listener_destroy(st.listener);
  for (ucp_ep_h ep : st.endpoints) CloseEndpoint(st.worker, ep);  // completes their sends
  for (ucp_ep_h ep : st.endpoints) st.DropJobs(ep);  // buffers of unfinished gathers go idle
  for (State::Buffer* b : st.idle) st.Free(b);
  if (st.worker != nullptr) ucp_worker_destroy(st.worker);
  if (st.context != nullptr) ucp_cleanup(st.context);
}

// ---------------------------------------------------------------------------------- client

struct UcxGatherChannel::State {
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
  s = ucp_ep_create(st.worker, &ep, &st.ep);
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

UcxGatherChannel::~UcxGatherChannel() {
  if (state_ == nullptr) return;
  State& st = *state_;
  st.ReleaseStale();
  if (st.ep != nullptr) CloseEndpoint(st.worker, st.ep);
  if (st.worker != nullptr) ucp_worker_destroy(st.worker);
  if (st.context != nullptr) ucp_cleanup(st.context);
}

bool UcxGatherChannel::broken() const { return state_->broken; }

absl::Status UcxGatherChannel::Gather(const std::vector<ClientGatherItem>& items,
                                      const std::vector<int64_t>& row_bytes,
                                      absl::Duration timeout) {
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
  while (!finished()) {
    if (st.broken) {
      status = absl::UnavailableError("the UCX connection to the KV store broke");
      break;
    }
    const unsigned progressed = ucp_worker_progress(st.worker);
    st.ReleaseStale();
    for (const auto& a : st.announced) st.Post(a);
    st.announced.clear();
    if (progressed == 0 && absl::Now() > deadline) {
      status = absl::DeadlineExceededError("UCX gather did not finish before its deadline");
      break;
    }
  }
  // Pieces of a failed gather that still come are released unread from here on (OnReply files
  // them as stale), not announced and forgotten: an unreleased rendezvous piece would keep the
  // store's send, and its reply buffer, pending for the connection's life.
  if (!status.ok()) st.waiting_for = 0;
  // Closing the endpoint by force completes every request on it. ucp_request_cancel is asked
  // first, but the UCX sources we read cancel only tag receives: an active message's send or
  // rendezvous receive runs on until it completes, so one that does not finish within a short
  // grace gets its endpoint closed.
  constexpr absl::Duration kGrace = absl::Milliseconds(100);
  auto force_close = [&] {
    if (st.ep != nullptr) CloseEndpoint(st.worker, st.ep);
    st.ep = nullptr;
    st.broken = true;
  };
  if (send != nullptr && !UCS_PTR_IS_ERR(send)) {
    if (ucp_request_check_status(send) == UCS_INPROGRESS) ucp_request_cancel(st.worker, send);
    const absl::Time grace = absl::Now() + kGrace;
    while (ucp_request_check_status(send) == UCS_INPROGRESS && !st.broken && absl::Now() < grace) {
      ucp_worker_progress(st.worker);
    }
    if (ucp_request_check_status(send) == UCS_INPROGRESS) force_close();
    ucp_request_free(send);
  }
  if (!status.ok()) {
    // The destinations belong to the caller: receives already posted may still write them, so
    // they finish (within the grace) or are ended with the endpoint before this returns.
    for (const auto& a : st.announced) st.stale.push_back(a.desc);
    st.announced.clear();
    for (auto& r : st.receives) {
      if (!r.done && r.request != nullptr) ucp_request_cancel(st.worker, r.request);
    }
    for (int attempt = 0; attempt < 2 && st.ReceivesPending(); ++attempt) {
      if (attempt == 1) force_close();
      const absl::Time cap = absl::Now() + (attempt == 0 ? kGrace : absl::Seconds(2));
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

}  // namespace infinigen
