#include "kv_store/client/control_plane.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "common/grpc/channel_args.h"
#include "common/grpc/status.h"
#include "common/status_macros.h"

namespace infinigen {
namespace {

namespace pb = kvstore::v1;

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

std::chrono::system_clock::time_point Deadline(absl::Duration timeout) {
  return std::chrono::system_clock::now() +
         std::chrono::microseconds(absl::ToInt64Microseconds(timeout));
}

void ToProto(const StoreAppend& a, pb::AppendRequest* r) {
  r->set_sequence_id(a.seq);
  r->set_layer(a.layer);
  r->set_start(a.start);
  r->set_num_tokens(a.n);
  if (a.staged_offset >= 0) {
    r->set_staged_offset(a.staged_offset);
    r->set_staged_bytes(static_cast<int64_t>(a.k.size()));
  } else {
    r->set_k(a.k.data(), a.k.size());
    r->set_v(a.v.data(), a.v.size());
  }
  r->mutable_slots()->Add(a.slots.begin(), a.slots.end());
}

}  // namespace

KvControlPlane::KvControlPlane(const KvClientConfig& config,
                               std::shared_ptr<grpc::ChannelCredentials> credentials)
    : config_(config),
      channel_(grpc::CreateCustomChannel(config.address, std::move(credentials),
                                         InternalChannelArgs(256 << 20))),
      stub_(pb::KvStore::NewStub(channel_)) {}

void KvControlPlane::Prepare(grpc::ClientContext& ctx, absl::Duration timeout) {
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

absl::StatusOr<StoreDescription> KvControlPlane::Describe(absl::Duration timeout) {
  grpc::ClientContext ctx;
  Prepare(ctx, timeout);
  pb::DescribeResponse r;
  IG_RETURN_IF_ERROR_GRPC(stub_->Describe(&ctx, pb::DescribeRequest(), &r));
  StoreDescription d;
  d.instance = r.instance();
  d.shm_path = r.shm_path();
  d.arena_bytes = r.arena_bytes();
  d.block_bytes = r.block_bytes();
  d.ucx_port = r.ucx_port();
  d.ucx_appends = r.ucx_appends();
  d.staging_dir = r.staging_dir();
  return d;
}

absl::StatusOr<uint64_t> KvControlPlane::Open(StoreSequenceId seq, const SequenceSpec& spec) {
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
  return resp.instance();
}

absl::StatusOr<KvControlPlane::Attached> KvControlPlane::Attach(StoreSequenceId from,
                                                                StoreSequenceId to,
                                                                const SequenceSpec& spec,
                                                                int64_t max_length, bool fork) {
  pb::AttachRequest req;
  req.set_fork(fork);
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
  return Attached{resp.length(), resp.instance()};
}

absl::Status KvControlPlane::Close(StoreSequenceId seq) {
  pb::CloseRequest req;
  req.set_sequence_id(seq);
  pb::CloseResponse resp;
  grpc::ClientContext ctx;
  Prepare(ctx, config_.call_timeout);
  return FromGrpcStatus(stub_->Close(&ctx, req, &resp));
}

absl::Status KvControlPlane::Release(StoreSequenceId seq) {
  pb::ReleaseRequest req;
  req.set_sequence_id(seq);
  pb::ReleaseResponse resp;
  grpc::ClientContext ctx;
  Prepare(ctx, config_.call_timeout);
  return FromGrpcStatus(stub_->Release(&ctx, req, &resp));
}

absl::Status KvControlPlane::Append(const StoreAppend& a) {
  pb::AppendRequest req;
  ToProto(a, &req);
  pb::AppendResponse resp;
  grpc::ClientContext ctx;
  Prepare(ctx, config_.call_timeout);
  return FromGrpcStatus(stub_->Append(&ctx, req, &resp));
}

pb::AppendBatchRequest AppendBatchRequestOf(const std::vector<StoreAppend>& appends,
                                            const std::string& staging_file,
                                            const std::string& released_staging_file) {
  pb::AppendBatchRequest req;
  for (const StoreAppend& a : appends) ToProto(a, req.add_appends());
  req.set_staging_file(staging_file);
  req.set_released_staging_file(released_staging_file);
  return req;
}

std::vector<absl::Status> AppendStatuses(const absl::Status& call,
                                         const pb::AppendBatchResponse& answer, size_t appends) {
  std::vector<absl::Status> statuses(appends, call);  // a failed call fails every append
  if (call.ok()) {
    for (const pb::AppendFailure& f : answer.failures()) {
      if (f.index() < 0 || f.index() >= static_cast<int>(appends)) continue;
      statuses[f.index()] = absl::Status(
          f.code() == 0 ? absl::StatusCode::kInternal : static_cast<absl::StatusCode>(f.code()),
          f.message());
    }
  }
  return statuses;
}

std::vector<absl::Status> KvControlPlane::AppendBatch(const std::vector<StoreAppend>& appends,
                                                      const std::string& staging_file,
                                                      absl::Status* call_status,
                                                      const std::string& released_staging_file) {
  const pb::AppendBatchRequest req =
      AppendBatchRequestOf(appends, staging_file, released_staging_file);
  pb::AppendBatchResponse resp;
  grpc::ClientContext ctx;
  Prepare(ctx, config_.call_timeout);
  const absl::Status call = FromGrpcStatus(stub_->AppendBatch(&ctx, req, &resp));
  if (call_status != nullptr) *call_status = call;
  return AppendStatuses(call, resp, appends.size());
}

absl::StatusOr<KvStoreStats> KvControlPlane::Stats() {
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

absl::Status KvControlPlane::Renew(const std::string& owner) {
  pb::RenewRequest req;
  req.set_owner(owner);
  pb::RenewResponse resp;
  grpc::ClientContext ctx;
  Prepare(ctx, config_.call_timeout);
  return FromGrpcStatus(stub_->Renew(&ctx, req, &resp));
}

absl::StatusOr<StoreBlockTable> KvControlPlane::Blocks(StoreSequenceId seq, int layer) {
  pb::BlocksRequest req;
  req.set_sequence_id(seq);
  req.set_layer(layer);
  pb::BlocksResponse r;
  grpc::ClientContext ctx;
  Prepare(ctx, config_.call_timeout);
  IG_RETURN_IF_ERROR_GRPC(stub_->Blocks(&ctx, req, &r));
  StoreBlockTable t;
  t.instance = r.instance();
  t.rows = r.rows();
  t.row_bytes = r.row_bytes();
  t.blocks_per_head = r.blocks_per_head();
  t.k_blocks.assign(r.k_blocks().begin(), r.k_blocks().end());
  t.v_blocks.assign(r.v_blocks().begin(), r.v_blocks().end());
  return t;
}

absl::Status KvControlPlane::Gather(const pb::GatherRequest& request,
                                    pb::GatherResponse* response) {
  grpc::ClientContext ctx;
  Prepare(ctx, config_.call_timeout);
  return FromGrpcStatus(stub_->Gather(&ctx, request, response));
}

}  // namespace infinigen
