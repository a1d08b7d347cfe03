#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_store/ucx/ucx_common.h"
#include "kv_store/ucx/ucx_data_plane.h"
#include "kv_store/ucx/ucx_wire.h"

namespace infinigen {
namespace {

// Items whose K rows (and V rows) are smaller than this travel several to a message (of up to
// kGroupBytes), which the worker receives into one buffer and copies out: two messages for every
// small item of a batch cost more than that copy (16 items, 0.5-4 MiB in all, over TCP:
// 1.1-2.4x slower than grouped).
constexpr size_t kSmallItem = 256 << 10, kGroupBytes = 1 << 20;

// A reply buffer's size for a gather of `bytes`: at least 64 KiB, rounded up to the next eighth
// of a power of two (at most an eighth more), so that a sequence whose gathers grow a row a step
// reuses one buffer for many steps. Sized exactly, each step's gather was a little larger than
// every idle buffer, and each mapped a new one (mmap, and page faults as the gather first wrote
// it) and unmapped the oldest.
size_t ReplyCapacity(size_t bytes) {
  constexpr size_t kSmallest = 64 << 10;
  if (bytes <= kSmallest) return kSmallest;
  const size_t step = std::bit_ceil(bytes) / 8;
  return (bytes + step - 1) / step * step;
}

}  // namespace

struct UcxDataServer::State {
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
  std::atomic<int64_t> buffers_mapped{0};

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

  // Append batches: received whole (a large one by rendezvous, posted from the loop), applied by
  // `on_append` from the loop in any order across workers (a worker has one in flight), and
  // answered. The job outlives its worker until its receive completes.
  UcxAppendHandler on_append;
  std::atomic<int64_t> append_batches{0};
  struct AppendJob {
    ucp_ep_h ep = nullptr;
    uint64_t id = 0;
    uint64_t request_bytes = 0;
    std::unique_ptr<uint8_t[]> message;  // the request, then the rows
    size_t capacity = 0;                 // of `message`
    size_t length = 0;
    void* desc = nullptr;  // a rendezvous message announced, its receive not posted yet
    bool receiving = false;
    bool failed = false;   // the receive failed
    bool dropped = false;  // its worker went away: no answer
  };
  std::vector<std::unique_ptr<AppendJob>> append_jobs;
  // Message buffers of answered appends, kept for the next (a fresh one's pages would be
  // faulted in at every batch: tens of megabytes each).
  std::vector<std::pair<std::unique_ptr<uint8_t[]>, size_t>> spare_messages;
  void TakeMessageBuffer(AppendJob& job) {  // the smallest spare that fits
    auto best = spare_messages.end();
    for (auto it = spare_messages.begin(); it != spare_messages.end(); ++it) {
      if (it->second >= job.length && (best == spare_messages.end() || it->second < best->second)) {
        best = it;
      }
    }
    if (best != spare_messages.end()) {
      job.message = std::move(best->first);
      job.capacity = best->second;
      spare_messages.erase(best);
      return;
    }
    job.capacity = std::max<size_t>(job.length, 1);
    job.message.reset(new uint8_t[job.capacity]);
  }
  void GiveBackMessageBuffer(AppendJob& job) {
    if (job.message == nullptr) return;
    if (spare_messages.size() >= 2) {  // keep the larger
      auto smallest =
          std::min_element(spare_messages.begin(), spare_messages.end(),
                           [](const auto& a, const auto& b) { return a.second < b.second; });
      if (smallest->second >= job.capacity) return;
      spare_messages.erase(smallest);
    }
    spare_messages.emplace_back(std::move(job.message), job.capacity);
  }

  // An answer being sent: its header and bytes live until the send completes.
  struct AppendReply {
    ReplyHeader header;
    std::string payload;
  };

  void Answer(ucp_ep_h ep, uint64_t id, const absl::StatusOr<std::string>& result) {
    append_batches.fetch_add(1);
    auto* reply = new AppendReply{{id, static_cast<int32_t>(result.status().code()), 0, 0},
                                  result.ok() ? *result : std::string(result.status().message())};
    ucp_request_param_t rp{};
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_EAGER;  // the worker reads answers in its callback
    rp.cb.send = [](void* request, ucs_status_t, void* user) {
      delete static_cast<AppendReply*>(user);
      ucp_request_free(request);
    };
    rp.user_data = reply;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, kAppendReply, &reply->header, sizeof(ReplyHeader),
                                         reply->payload.data(), reply->payload.size(), &rp);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) delete reply;  // done at once, or failed
  }

  static ucs_status_t OnAppend(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param) {
    auto* st = static_cast<State*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        header_length != sizeof(AppendHeader)) {
      return UCS_OK;  // nobody to answer
    }
    AppendHeader h;
    std::memcpy(&h, header, sizeof(h));
    absl::Status refused;
    if (!st->on_append) {
      refused = absl::UnimplementedError("this KV store takes no appends over UCX");
    } else if (length > kMaxUcxAppendBytes) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("an append message of ", length, " bytes is over the ", kMaxUcxAppendBytes,
                       "-byte limit: send fewer rows per batch"));
    } else if (h.request_bytes > length) {
      refused = absl::InvalidArgumentError(absl::StrCat("the append request's ", h.request_bytes,
                                                        " bytes are more than the ", length,
                                                        " of its message"));
    }
    if (!refused.ok()) {
      st->Answer(param->reply_ep, h.id, refused);
      return UCS_OK;  // a rendezvous message is released unread
    }
    auto job = std::make_unique<AppendJob>();
    job->ep = param->reply_ep;
    job->id = h.id;
    job->request_bytes = h.request_bytes;
    job->length = length;
    st->TakeMessageBuffer(*job);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (rndv) {
      job->desc = data;
    } else {
      std::memcpy(job->message.get(), data, length);
    }
    st->append_jobs.push_back(std::move(job));
    return rndv ? UCS_INPROGRESS : UCS_OK;
  }

  // Posts the announced receives, then applies and answers every append batch received. True
  // if anything happened.
  bool AdvanceAppends() {
    bool any = false;
    for (auto& j : append_jobs) {
      if (j->desc == nullptr) continue;
      any = true;
      void* desc = std::exchange(j->desc, nullptr);
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user) {
        auto* job = static_cast<AppendJob*>(user);
        job->receiving = false;
        job->failed = status != UCS_OK;
        ucp_request_free(request);
      };
      rp.user_data = j.get();
      j->receiving = true;
      ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker, desc, j->message.get(), j->length, &rp);
      if (r == nullptr) {
        j->receiving = false;  // completed at once
      } else if (UCS_PTR_IS_ERR(r)) {
        j->receiving = false;
        j->failed = true;
      }
    }
    for (auto it = append_jobs.begin(); it != append_jobs.end();) {
      AppendJob& j = **it;
      if (j.receiving || j.desc != nullptr) {
        ++it;
        continue;
      }
      any = true;
      if (!j.dropped && j.failed) {
        Answer(j.ep, j.id, absl::UnavailableError("the append message was not received whole"));
      } else if (!j.dropped) {
        const std::span<const uint8_t> message(j.message.get(), j.length);
        Answer(j.ep, j.id,
               on_append(message.first(j.request_bytes), message.subspan(j.request_bytes)));
      }
      GiveBackMessageBuffer(j);
      it = append_jobs.erase(it);
    }
    return any;
  }

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
    b->capacity = ReplyCapacity(bytes);
    buffers_mapped.fetch_add(1, std::memory_order_relaxed);
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
  // nothing is sized from them before they are checked (ucx_wire.h, CountMatches).
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
      for (auto& j : append_jobs) {
        if (j->ep != ep) continue;
        j->dropped = true;
        if (j->desc != nullptr) ucp_am_data_release(worker, std::exchange(j->desc, nullptr));
      }
      auto at = std::find(endpoints.begin(), endpoints.end(), ep);
      if (at == endpoints.end()) continue;  // reported twice
      endpoints.erase(at);
      CloseUcxEndpoint(worker, ep);
    }
    connected.store(static_cast<int>(endpoints.size()));
  }

  // Polls without sleeping for this long after the last event: a worker's gathers come a layer
  // apart (well under a millisecond on a GPU), and waking from poll costs tens of microseconds
  // per gather on a VM (0.5 MiB over TCP: 215 -> 176 us p50 with the spin).
  static constexpr std::chrono::microseconds kSpinAfterActivity{1000};
  std::chrono::steady_clock::time_point last_activity;
  bool gathered = false;  // a gather was served since the last progress

  void Loop() {
    const int fd = [&] {
      int efd = -1;
      ucp_worker_get_efd(worker, &efd);
      return efd;
    }();
    while (!stop.load()) {
      const unsigned progressed = ucp_worker_progress(worker);
      if (!failed.empty()) DropFailed();
      if (!append_jobs.empty() && AdvanceAppends()) continue;
      if (!jobs.empty()) {
        Advance();
        gathered = true;
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      if (progressed != 0) {
        // Only gathers start the spin: appends come a few milliseconds apart (the client's
        // linger), and a spin after each took cores a collocated worker computes on.
        if (std::exchange(gathered, false)) last_activity = now;
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

absl::StatusOr<std::unique_ptr<UcxDataServer>> UcxDataServer::Start(KvStore& store, int port,
                                                                    UcxAppendHandler on_append) {
  // A restarted store must get its port back while the old connections sit in TIME_WAIT (UCX
  // does not set SO_REUSEADDR by default). The environment still wins when it says otherwise.
  ::setenv("UCX_TCP_CM_REUSEADDR", "y", /*overwrite=*/0);
  std::unique_ptr<UcxDataServer> server(new UcxDataServer());
  server->state_ = std::make_unique<State>();
  State& st = *server->state_;
  st.store = &store;
  st.on_append = std::move(on_append);
  if (auto s = InitUcxWorker(&st.context, &st.worker); !s.ok()) return s;
  IG_RETURN_IF_ERROR(SetUcxAmHandler(st.worker, kGatherRequest, State::OnRequest, &st));
  // Refused with UNIMPLEMENTED without `on_append`.
  IG_RETURN_IF_ERROR(SetUcxAmHandler(st.worker, kAppendRequest, State::OnAppend, &st));
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
  ucs_status_t s = ucp_listener_create(st.worker, &lp, &st.listener);
  if (s != UCS_OK) return UcsError(absl::StrCat("listen on port ", port).c_str(), s);
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (ucp_listener_query(st.listener, &attr) == UCS_OK) {
    server->port_ = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  }
  st.progress = std::thread([&st] { st.Loop(); });
  return server;
}

int UcxDataServer::connected_workers() const { return state_->connected.load(); }

int64_t UcxDataServer::append_batches() const { return state_->append_batches.load(); }

int64_t UcxDataServer::reply_buffers_mapped() const { return state_->buffers_mapped.load(); }

UcxDataServer::~UcxDataServer() {
  if (state_ == nullptr) return;
  State& st = *state_;
  st.stop.store(true);
  if (st.progress.joinable()) st.progress.join();
  if (st.listener != nullptr) ucp_listener_destroy(st.listener);
  for (ucp_ep_h ep : st.endpoints) CloseUcxEndpoint(st.worker, ep);  // completes their sends
  for (ucp_ep_h ep : st.endpoints) st.DropJobs(ep);  // buffers of unfinished gathers go idle
  // Closing the endpoints ended every posted receive; announced ones are released unread.
  for (auto& j : st.append_jobs) {
    if (j->desc != nullptr) ucp_am_data_release(st.worker, j->desc);
  }
  st.append_jobs.clear();
  for (State::Buffer* b : st.idle) st.Free(b);
  if (st.worker != nullptr) ucp_worker_destroy(st.worker);
  if (st.context != nullptr) ucp_cleanup(st.context);
}

}  // namespace infinigen
