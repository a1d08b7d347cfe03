// The gRPC transport (rows in the messages) and the shm transport (gRPC for control; gathers
// copy rows straight out of the collocated store's arena, mapped read-only here, using block
// tables fetched once per block of new rows: no RPC per gather).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc/channel_args.h"
#include "common/grpc/status.h"
#include "common/grpc/tls.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "infinigen/kvstore/v1/kvstore.grpc.pb.h"
#include "kv_store/client/queued_client.h"
#include "kv_store/client/transports.h"
#include "kv_store/row_copy.h"
#if INFINIGEN_HAVE_UCX
#include "kv_store/ucx/ucx_data_plane.h"
#endif

namespace infinigen {
namespace {

namespace pb = kvstore::v1;

// shm gathers copying at least this many bytes use the client's copy threads.
constexpr size_t kParallelCopyBytes = 2 << 20;

#define IG_RETURN_IF_ERROR_GRPC(call)                                  \
  do {                                                                 \
    const grpc::Status _ig_grpc_status = (call);                       \
    if (!_ig_grpc_status.ok()) return FromGrpcStatus(_ig_grpc_status); \
  } while (0)

pb::DType ToProto(DType d) {
  switch (d) {
    case DType::kF32:
      return pb::DTYPE_F32;
    case DType::kF16:
      return pb::DTYPE_F16;
    case DType::kBF16:
      return pb::DTYPE_BF16;
  }
  return pb::DTYPE_UNSPECIFIED;
}

pb::Eviction ToProto(EvictionPolicy e) {
  switch (e) {
    case EvictionPolicy::kCounter:
      return pb::EVICTION_COUNTER;
    case EvictionPolicy::kFifo:
      return pb::EVICTION_FIFO;
    case EvictionPolicy::kLru:
      return pb::EVICTION_LRU;
  }
  return pb::EVICTION_UNSPECIFIED;
}

class GrpcClient final : public QueuedKvClient {
 public:
  GrpcClient(const KvClientConfig& config, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : QueuedKvClient(config) {
    channel_ = grpc::CreateCustomChannel(config.address, std::move(credentials),
                                         InternalChannelArgs(256 << 20));
    stub_ = pb::KvStore::NewStub(channel_);
    Start();
  }
  ~GrpcClient() override {
    Stop();
    if (arena_ != nullptr) ::munmap(const_cast<uint8_t*>(arena_), arena_bytes_);
  }
  std::string transport() const override {
    switch (config_.transport) {
      case KvClientConfig::Transport::kShm:
        return "shm";
      case KvClientConfig::Transport::kUcx:
        return "ucx";
      default:
        return "grpc";
    }
  }

  // Connects the UCX data plane the store advertises (ucx transport).
  absl::Status ConnectUcx() {
#if INFINIGEN_HAVE_UCX
    grpc::ClientContext ctx;
    Prepare(ctx, config_.connect_timeout);
    pb::DescribeResponse resp;
    IG_RETURN_IF_ERROR_GRPC(stub_->Describe(&ctx, pb::DescribeRequest(), &resp));
    if (resp.ucx_port() == 0) {
      return absl::FailedPreconditionError(
          "the KV store serves no UCX data plane (start it with --ucx_port)");
    }
    const std::string host = config_.address.substr(0, config_.address.rfind(':'));
    IG_ASSIGN_OR_RETURN(ucx_, UcxGatherChannel::Connect(host, resp.ucx_port()));
    return absl::OkStatus();
#else
    return absl::UnimplementedError("this build has no UCX");
#endif
  }

  // Maps the store's arena (shm transport).
  absl::Status MapArena() {
    grpc::ClientContext ctx;
    Prepare(ctx, config_.connect_timeout);
    pb::DescribeResponse resp;
    IG_RETURN_IF_ERROR_GRPC(stub_->Describe(&ctx, pb::DescribeRequest(), &resp));
    if (resp.shm_path().empty()) {
      return absl::FailedPreconditionError(
          "the KV store does not share its arena (--shared_memory=false): use the grpc transport");
    }
    const int fd = ::open(resp.shm_path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::PermissionDeniedError(absl::StrCat(
          "cannot open the KV store's arena ", resp.shm_path(), ": ", std::strerror(errno),
          " (the shm transport needs the store on this host, with the same user or a shared "
          "memory volume)"));
    }
    void* p = ::mmap(nullptr, resp.arena_bytes(), PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      return absl::InternalError(
          absl::StrCat("cannot map the KV store's arena: ", std::strerror(errno)));
    }
    // A restarted store: what was known of the old one's blocks is void, and its arena goes.
    if (arena_ != nullptr) ::munmap(const_cast<uint8_t*>(arena_), arena_bytes_);
    tables_.clear();
    {
      absl::MutexLock lock(&appended_mu_);
      appended_.clear();
    }
    arena_ = static_cast<const uint8_t*>(p);
    arena_bytes_ = static_cast<size_t>(resp.arena_bytes());
    block_bytes_ = resp.block_bytes();
    instance_ = resp.instance();
    return absl::OkStatus();
  }

 protected:
  absl::Status DoOpen(StoreSequenceId seq, const SequenceSpec& spec) override {
    pb::OpenRequest req;
    req.set_sequence_id(seq);
    req.set_num_layers(spec.num_layers);
    req.set_num_kv_heads(spec.num_kv_heads);
    req.set_head_dim(spec.head_dim);
    req.set_dtype(ToProto(spec.dtype));
    req.set_capacity_tokens(spec.capacity_tokens);
    req.set_eviction(ToProto(spec.eviction));
    req.set_owner(spec.owner);
    pb::OpenResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, config_.call_timeout);
    IG_RETURN_IF_ERROR_GRPC(stub_->Open(&ctx, req, &resp));
    // The store restarted since its arena was mapped: map the new one. Rows answered in place
    // before are void from here; the worker opens sequences between steps, holding none.
    if (shm_ && resp.instance() != instance_) IG_RETURN_IF_ERROR(MapArena());
    specs_[seq] = spec;
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> DoAttach(StoreSequenceId from, StoreSequenceId to,
                                   const SequenceSpec& spec, int64_t max_length) override {
    pb::AttachRequest req;
    req.set_from_sequence_id(from);
    req.set_sequence_id(to);
    req.set_owner(spec.owner);
    req.set_max_length(max_length);
    req.set_num_layers(spec.num_layers);
    req.set_num_kv_heads(spec.num_kv_heads);
    req.set_head_dim(spec.head_dim);
    req.set_dtype(ToProto(spec.dtype));
    pb::AttachResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, config_.call_timeout);
    IG_RETURN_IF_ERROR_GRPC(stub_->Attach(&ctx, req, &resp));
    if (shm_ && resp.instance() != instance_) IG_RETURN_IF_ERROR(MapArena());
    specs_[to] = spec;
    return resp.length();
  }

  absl::Status DoClose(StoreSequenceId seq) override {
    pb::CloseRequest req;
    req.set_sequence_id(seq);
    pb::CloseResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, config_.call_timeout);
    specs_.erase(seq);
    for (auto it = tables_.begin(); it != tables_.end();) {
      if (it->first.first == seq) {
        tables_.erase(it++);
      } else {
        ++it;
      }
    }
    if (shm_) {
      absl::MutexLock lock(&appended_mu_);
      absl::erase_if(appended_, [seq](const auto& e) { return e.first.first == seq; });
    }
    return FromGrpcStatus(stub_->Close(&ctx, req, &resp));
  }

  absl::Status DoAppend(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                        const std::vector<uint8_t>& k, const std::vector<uint8_t>& v) override {
    pb::AppendRequest req;
    req.set_sequence_id(seq);
    req.set_layer(layer);
    req.set_start(start);
    req.set_num_tokens(n);
    req.set_k(k.data(), k.size());
    req.set_v(v.data(), v.size());
    pb::AppendResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, config_.call_timeout);
    absl::Status st = FromGrpcStatus(stub_->Append(&ctx, req, &resp));
    NoteAppended(seq, layer, st.ok() ? start + n : kAppendFailed);
    return st;
  }

  // One AppendBatch call for everything that piled up (an Append each costs a round trip). The
  // store applies each append on its own and lists the failed ones.
  std::vector<absl::Status> DoAppendBatch(const std::vector<AppendJob>& jobs) override {
    if (jobs.size() == 1) {
      const AppendJob& j = jobs[0];
      return {DoAppend(j.seq, j.layer, j.start, j.n, j.k, j.v)};
    }
    pb::AppendBatchRequest req;
    for (const AppendJob& j : jobs) {
      pb::AppendRequest* a = req.add_appends();
      a->set_sequence_id(j.seq);
      a->set_layer(j.layer);
      a->set_start(j.start);
      a->set_num_tokens(j.n);
      a->set_k(j.k.data(), j.k.size());
      a->set_v(j.v.data(), j.v.size());
    }
    pb::AppendBatchResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, config_.call_timeout);
    const absl::Status call = FromGrpcStatus(stub_->AppendBatch(&ctx, req, &resp));
    std::vector<absl::Status> statuses(jobs.size(), call);  // a failed call fails every append
    if (call.ok()) {
      for (const pb::AppendFailure& f : resp.failures()) {
        if (f.index() < 0 || f.index() >= static_cast<int>(jobs.size())) continue;
        statuses[f.index()] = absl::Status(
            f.code() == 0 ? absl::StatusCode::kInternal : static_cast<absl::StatusCode>(f.code()),
            f.message());
      }
    }
    for (size_t i = 0; i < jobs.size(); ++i) {
      NoteAppended(jobs[i].seq, jobs[i].layer,
                   statuses[i].ok() ? jobs[i].start + jobs[i].n : kAppendFailed);
    }
    return statuses;
  }

  bool reads_in_place() const override { return shm_; }
  Span mapped_memory() const override { return {arena_, arena_bytes_}; }

  absl::Status DoGather(const std::vector<ClientGatherItem>& items) override {
    if (arena_ != nullptr) return GatherShm(items);
    // The caller sized its buffers for the rows of sequences it opened through this client.
    std::vector<int64_t> row_bytes;
    for (const auto& it : items) {
      if (it.k_rows != nullptr || it.v_rows != nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the ", transport(), " transport copies rows; it cannot gather them in place"));
      }
      auto spec = specs_.find(it.seq);
      if (spec == specs_.end()) {
        return absl::NotFoundError(
            absl::StrCat("sequence ", it.seq, " is not open on this client"));
      }
      row_bytes.push_back(spec->second.row_bytes());
    }
#if INFINIGEN_HAVE_UCX
    if (config_.transport == KvClientConfig::Transport::kUcx) {
      if (ucx_ == nullptr || ucx_->broken()) {  // store restarted, or a transfer abandoned
        ucx_.reset();
        if (absl::Status st = ConnectUcx(); !st.ok()) {
          return absl::UnavailableError(
              absl::StrCat("the UCX data plane of the KV store is unreachable: ", st.message()));
        }
      }
      return ucx_->Gather(items, row_bytes, config_.call_timeout);
    }
#endif
    return GatherOverGrpc(items, row_bytes);
  }

  // A gather over the control plane, in calls whose replies stay under
  // config_.max_gather_reply_bytes: items are cut into pieces of rows (every KV head's rows
  // [r0, r1) of the item), and pieces go several to a call. Each piece's reply rows are written
  // where the item's buffers expect them.
  absl::Status GatherOverGrpc(const std::vector<ClientGatherItem>& items,
                              const std::vector<int64_t>& row_bytes) {
    struct Piece {
      size_t item;
      int64_t r0, r1;
      bool whole;  // the item as the caller made it (not cut)
    };
    std::vector<Piece> pieces;
    for (size_t i = 0; i < items.size(); ++i) {
      const ClientGatherItem& it = items[i];
      // Only a well-formed item ([heads, count] slots) is cut; anything else goes whole, for
      // the store to refuse with its reason (a count whose product with the heads wraps, ...).
      const int64_t heads = specs_.at(it.seq).num_kv_heads;
      const bool well_formed = it.count > 0 && heads > 0 &&
                               it.count <= static_cast<int64_t>(it.slots.size()) &&
                               static_cast<int64_t>(it.slots.size()) == heads * it.count;
      const size_t per_row = 2 * static_cast<size_t>(std::max<int64_t>(heads, 1) * row_bytes[i]);
      const int64_t rows = std::max<int64_t>(
          1, static_cast<int64_t>(config_.max_gather_reply_bytes / std::max<size_t>(per_row, 1)));
      if (!well_formed || it.count <= rows) {
        pieces.push_back({i, 0, it.count, !well_formed});
        continue;
      }
      for (int64_t r0 = 0; r0 < it.count; r0 += rows) {
        pieces.push_back({i, r0, std::min(it.count, r0 + rows), false});
      }
    }
    for (size_t p0 = 0; p0 < pieces.size();) {
      pb::GatherRequest req;
      size_t bytes = 0, p1 = p0;
      for (; p1 < pieces.size(); ++p1) {
        const Piece& pc = pieces[p1];
        const ClientGatherItem& it = items[pc.item];
        const int64_t heads = specs_.at(it.seq).num_kv_heads;
        const size_t piece_bytes =
            pc.whole ? 0 : 2 * static_cast<size_t>(heads * (pc.r1 - pc.r0) * row_bytes[pc.item]);
        if (p1 > p0 && bytes + piece_bytes > config_.max_gather_reply_bytes) break;
        bytes += piece_bytes;
        auto* item = req.add_items();
        item->set_sequence_id(it.seq);
        item->set_layer(it.layer);
        item->set_count(pc.r1 - pc.r0);
        if (pc.whole || (pc.r0 == 0 && pc.r1 == it.count)) {
          item->mutable_slots()->Add(it.slots.begin(), it.slots.end());
          continue;
        }
        for (int64_t g = 0; g < heads; ++g) {
          const auto first = it.slots.begin() + g * it.count;
          item->mutable_slots()->Add(first + pc.r0, first + pc.r1);
        }
      }
      pb::GatherResponse resp;
      grpc::ClientContext ctx;
      Prepare(ctx, config_.call_timeout);
      IG_RETURN_IF_ERROR_GRPC(stub_->Gather(&ctx, req, &resp));
      if (resp.results_size() != static_cast<int>(p1 - p0)) {
        return absl::InternalError("the KV store answered a gather with the wrong number of items");
      }
      // The store is a peer on the network: its reply fills the caller's buffers only if it is
      // exactly what they were sized for (a store of another version, or a bug, must not overrun
      // them or leave last step's rows in them with an OK).
      for (size_t p = p0; p < p1; ++p) {
        const auto& r = resp.results(static_cast<int>(p - p0));
        const size_t want = static_cast<size_t>(req.items(static_cast<int>(p - p0)).slots_size()) *
                            static_cast<size_t>(row_bytes[pieces[p].item]);
        if (r.k().size() != want || r.v().size() != want) {
          return absl::InternalError(absl::StrCat(
              "the KV store answered item ", pieces[p].item, " of a gather with ", r.k().size(),
              " + ", r.v().size(), " bytes; its rows take ", want, " each"));
        }
      }
      for (size_t p = p0; p < p1; ++p) {
        const auto& r = resp.results(static_cast<int>(p - p0));
        const Piece& pc = pieces[p];
        const ClientGatherItem& it = items[pc.item];
        if (r.k().empty()) continue;
        if (pc.whole || (pc.r0 == 0 && pc.r1 == it.count)) {  // the item's own layout
          std::memcpy(it.k_out, r.k().data(), r.k().size());
          std::memcpy(it.v_out, r.v().data(), r.v().size());
          continue;
        }
        const size_t row = static_cast<size_t>(row_bytes[pc.item]);
        const size_t piece_rows = static_cast<size_t>(pc.r1 - pc.r0);
        const int64_t heads = specs_.at(it.seq).num_kv_heads;
        for (int64_t g = 0; g < heads; ++g) {
          const size_t dst = (static_cast<size_t>(g * it.count + pc.r0)) * row;
          const size_t src = static_cast<size_t>(g) * piece_rows * row;
          std::memcpy(it.k_out + dst, r.k().data() + src, piece_rows * row);
          std::memcpy(it.v_out + dst, r.v().data() + src, piece_rows * row);
        }
      }
      p0 = p1;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<KvStoreStats> DoStats() override {
    pb::StatsResponse r;
    grpc::ClientContext ctx;
    Prepare(ctx, config_.call_timeout);
    IG_RETURN_IF_ERROR_GRPC(stub_->Stats(&ctx, pb::StatsRequest(), &r));
    KvStoreStats s;
    s.sequences = r.sequences();
    s.bytes_capacity = r.bytes_capacity();
    s.bytes_used = r.bytes_used();
    s.tokens_stored = r.tokens_stored();
    s.appends = r.appends();
    s.gathers = r.gathers();
    s.bytes_gathered = r.bytes_gathered();
    s.evictions = r.evictions();
    s.rejections = r.rejections();
    s.leases_expired = r.leases_expired();
    s.block_bytes = r.block_bytes();
    return s;
  }

  absl::Status DoRenew() override {
    pb::RenewRequest req;
    req.set_owner(config_.owner);
    pb::RenewResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, config_.call_timeout);
    return FromGrpcStatus(stub_->Renew(&ctx, req, &resp));
  }

 private:
  struct Table {
    int64_t rows = 0, row_bytes = 0, blocks_per_head = 0;
    std::vector<int32_t> k_blocks, v_blocks;  // [heads, blocks_per_head]
  };

  // Sets the call's deadline, then waits (up to half the timeout, at most 500 ms) for a channel
  // that is not connected to connect. A channel that lost its store reconnects through
  // attempts whose completion only a thread polling the channel notices; fail-fast calls do
  // not poll, and gRPC's backup poller runs every 5 s, so without this wait a restarted store
  // was reached only after ~5 s of UNAVAILABLE. After a wait that failed, calls fail at once
  // for as long as that wait (the store is gone: a step's append and gathers each waiting 1 s
  // made a dead store reach clients only after 2-3 s); the next call after that waits again.
  void Prepare(grpc::ClientContext& ctx, absl::Duration timeout) {
    ctx.set_deadline(Deadline(timeout));  // the wait counts against the call's timeout
    if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) return;
    {
      absl::MutexLock lock(&reconnect_mu_);
      if (absl::Now() < no_wait_until_) return;
    }
    const absl::Duration wait = std::min(timeout / 2, absl::Milliseconds(500));
    if (!channel_->WaitForConnected(Deadline(wait))) {
      absl::MutexLock lock(&reconnect_mu_);
      no_wait_until_ = absl::Now() + wait;
    }
  }
  static std::chrono::system_clock::time_point Deadline(absl::Duration timeout) {
    return std::chrono::system_clock::now() +
           std::chrono::microseconds(absl::ToInt64Microseconds(timeout));
  }

  absl::Status RefreshTable(StoreSequenceId seq, int layer, Table& t) {
    pb::BlocksRequest req;
    req.set_sequence_id(seq);
    req.set_layer(layer);
    pb::BlocksResponse r;
    grpc::ClientContext ctx;
    Prepare(ctx, config_.call_timeout);
    IG_RETURN_IF_ERROR_GRPC(stub_->Blocks(&ctx, req, &r));
    if (r.instance() != instance_) {  // blocks of another run's arena than the one mapped
      return absl::UnavailableError(
          "the KV store restarted: its sequences are gone and its arena is mapped at the next "
          "Open");
    }
    t.rows = r.rows();
    t.row_bytes = r.row_bytes();
    t.blocks_per_head = r.blocks_per_head();
    t.k_blocks.assign(r.k_blocks().begin(), r.k_blocks().end());
    t.v_blocks.assign(r.v_blocks().begin(), r.v_blocks().end());
    return absl::OkStatus();
  }

  // Rows [0, rows) of `layer` of `seq` are in the store since an append of this client ended
  // there (-1: none appended yet; kAppendFailed after a failed append). The shm transport reads
  // rows without asking.
  static constexpr int64_t kAppendFailed = -2;
  void NoteAppended(StoreSequenceId seq, int layer, int64_t rows) {
    if (!shm_) return;
    absl::MutexLock lock(&appended_mu_);
    appended_[{seq, layer}] = rows;
  }
  int64_t Appended(StoreSequenceId seq, int layer) {
    absl::MutexLock lock(&appended_mu_);
    auto it = appended_.find({seq, layer});
    return it == appended_.end() ? -1 : it->second;
  }

  absl::Status GatherShm(const std::vector<ClientGatherItem>& items) {
    copies_.clear();
    size_t copy_bytes = 0;
    for (const auto& it : items) {
      auto spec = specs_.find(it.seq);
      if (spec == specs_.end()) {
        return absl::NotFoundError(
            absl::StrCat("sequence ", it.seq, " is not open on this client"));
      }
      const int heads = spec->second.num_kv_heads;
      if (it.layer < 0 || it.layer >= spec->second.num_layers) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", it.layer, " out of range"));
      }
      if (!CountMatches(it.count, heads, it.slots.size())) {
        return absl::InvalidArgumentError(absl::StrCat(it.slots.size(), " indices given for ",
                                                       it.count, " rows x ", heads, " KV heads"));
      }
      Table& t = tables_[{it.seq, it.layer}];
      int32_t max_slot = -1;
      for (int32_t s : it.slots) max_slot = std::max(max_slot, s);
      // Rows this client appended itself need no RPC while they lie in blocks the table
      // already lists (a new block every block_bytes_ / row_bytes tokens); a KV pool's slots
      // are not positions, so its tables are asked for.
      const int64_t per_block = block_bytes_ / spec->second.row_bytes();
      // After a failed append the store may have restarted (its arena mapped anew, a file it
      // reuses truncated) or dropped the sequence: ask it before reading the mapping.
      const int64_t appended = Appended(it.seq, it.layer);
      const bool ask = appended == kAppendFailed;
      int64_t rows = appended >= 0 && spec->second.capacity_tokens == 0 ? appended : t.rows;
      if (ask || max_slot >= rows || max_slot >= t.blocks_per_head * per_block) {
        IG_RETURN_IF_ERROR(RefreshTable(it.seq, it.layer, t));
        rows = t.rows;
      }
      for (int32_t slot : it.slots) {
        if (slot < 0 || slot >= rows) {
          return absl::InvalidArgumentError(
              absl::StrCat("token index ", slot, " is outside [0, ", rows, ")"));
        }
      }
      const bool in_place = it.k_rows != nullptr && it.v_rows != nullptr;
      for (int g = 0; g < heads; ++g) {
        const int32_t* idx = it.slots.data() + g * it.count;
        if (in_place) {
          HeadRowAddresses(HeadView(t, g, per_block), idx, it.count, it.k_rows + g * it.count,
                           it.v_rows + g * it.count);
        }
        if (!in_place && it.count > 0) {
          copies_.push_back({&it, &t, g, per_block});
          copy_bytes += 2 * static_cast<size_t>(it.count * t.row_bytes);
        }
      }
    }
    // Every item checked: copy the rows, one (item, KV head) per task.
    auto copy = [&](int64_t u) { CopyRows(copies_[u]); };
    if (copy_bytes >= kParallelCopyBytes && config_.gather_threads > 1) {
      if (pool_ == nullptr) pool_ = std::make_unique<ThreadPool>(config_.gather_threads);
      pool_->ParallelFor(static_cast<int64_t>(copies_.size()), copy);
    } else {
      for (int64_t u = 0; u < static_cast<int64_t>(copies_.size()); ++u) copy(u);
    }
    return absl::OkStatus();
  }

  // One KV head of an item, read from the mapped arena.
  struct CopyJob {
    const ClientGatherItem* item;
    const Table* table;
    int head;
    int64_t per_block;
  };
  void CopyRows(const CopyJob& c) const {
    const ClientGatherItem& it = *c.item;
    const Table& t = *c.table;
    const int g = c.head;
    const int32_t* idx = it.slots.data() + g * it.count;
    const size_t dst = static_cast<size_t>(g * it.count * t.row_bytes);
    CopyHeadRows(HeadView(t, g, c.per_block), idx, it.count, it.k_out + dst, it.v_out + dst);
  }
  // One KV head's rows of a layer in the mapped arena.
  HeadRowsView HeadView(const Table& t, int head, int64_t per_block) const {
    return {arena_,
            static_cast<size_t>(block_bytes_),
            t.k_blocks.data() + head * t.blocks_per_head,
            t.v_blocks.data() + head * t.blocks_per_head,
            t.row_bytes,
            per_block};
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::KvStore::Stub> stub_;
#if INFINIGEN_HAVE_UCX
  std::unique_ptr<UcxGatherChannel> ucx_;
  absl::Mutex reconnect_mu_;  // Prepare runs on the append and the queue threads
  absl::Time no_wait_until_ ABSL_GUARDED_BY(reconnect_mu_) = absl::InfinitePast();
#endif
  const bool shm_ = config_.transport == KvClientConfig::Transport::kShm;
  // The mapped arena (shm; queue-thread state once the client is made).
  const uint8_t* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  int64_t block_bytes_ = 0;
  uint64_t instance_ = 0;  // the run of the store whose arena is mapped
  // Queue-thread state.
  absl::flat_hash_map<StoreSequenceId, SequenceSpec> specs_;
  std::map<std::pair<StoreSequenceId, int>, Table> tables_;  // node-based: stable addresses
  std::vector<CopyJob> copies_;
  std::unique_ptr<ThreadPool> pool_;  // shm copies of large gathers
  // Append-thread state read by gathers (shm).
  absl::Mutex appended_mu_;
  absl::flat_hash_map<std::pair<StoreSequenceId, int>, int64_t> appended_
      ABSL_GUARDED_BY(appended_mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeGrpcClient(const KvClientConfig& config) {
  IG_ASSIGN_OR_RETURN(auto credentials, MakeChannelCredentials(config.tls, "--kv_store_tls_"));
  auto client = std::make_unique<GrpcClient>(config, std::move(credentials));
  if (config.transport == KvClientConfig::Transport::kShm) {
    IG_RETURN_IF_ERROR(client->MapArena());
  }
  if (config.transport == KvClientConfig::Transport::kUcx) {
    IG_RETURN_IF_ERROR(client->ConnectUcx());
  }
  return std::unique_ptr<KvStoreClient>(std::move(client));
}

}  // namespace infinigen
