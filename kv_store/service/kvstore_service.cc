#include "kv_store/service/kvstore_service.h"

#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/grpc/status.h"

namespace infinigen {
namespace {

using namespace kvstore::v1;  // NOLINT: message types of this service

absl::StatusOr<infinigen::DType> ToDType(kvstore::v1::DType d) {
  switch (d) {
    case DTYPE_F32:
      return infinigen::DType::kF32;
    case DTYPE_F16:
      return infinigen::DType::kF16;
    case DTYPE_BF16:
      return infinigen::DType::kBF16;
    default:
      return absl::InvalidArgumentError("dtype must be DTYPE_F32, DTYPE_F16 or DTYPE_BF16");
  }
}

// The layout and owner an Open or an Attach names.
template <typename Request>
absl::StatusOr<SequenceSpec> SpecOf(const Request& req) {
  auto dtype = ToDType(req.dtype());
  if (!dtype.ok()) return dtype.status();
  SequenceSpec spec;
  spec.num_layers = static_cast<int>(req.num_layers());
  spec.num_kv_heads = static_cast<int>(req.num_kv_heads());
  spec.head_dim = static_cast<int>(req.head_dim());
  spec.dtype = *dtype;
  spec.owner = req.owner();
  return spec;
}

}  // namespace

namespace {

// Where clients stage appends: the folder of a shared arena's file, or /dev/shm for an arena
// shared through /proc (no file of its own: the same host and user); "" when not shared.
std::string StagingDirOf(const std::string& share_path) {
  const size_t slash = share_path.rfind('/');
  if (share_path.empty() || slash == std::string::npos) return "";
  if (share_path.rfind("/proc/", 0) == 0) {
    struct stat st {};
    return ::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) ? "/dev/shm" : "";
  }
  return slash == 0 ? "/" : share_path.substr(0, slash);
}

}  // namespace

KvStoreService::KvStoreService(infinigen::KvStore& store, Clock clock)
    : store_(store),
      clock_(std::move(clock)),
      instance_([] {
        std::random_device rd;
        return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
      }()),
      staging_(StagingDirOf(store.arena().share_path())) {}

grpc::Status KvStoreService::Open(grpc::ServerContext*, const OpenRequest* req,
                                  OpenResponse* resp) {
  resp->set_instance(instance_);
  auto parsed = SpecOf(*req);
  if (!parsed.ok()) return ToGrpcStatus(parsed.status());
  SequenceSpec& spec = *parsed;
  spec.capacity_tokens = req->capacity_tokens();
  switch (req->eviction()) {
    case EVICTION_FIFO:
      spec.eviction = EvictionPolicy::kFifo;
      break;
    case EVICTION_LRU:
      spec.eviction = EvictionPolicy::kLru;
      break;
    default:
      spec.eviction = EvictionPolicy::kCounter;
  }
  return ToGrpcStatus(store_.Open(req->sequence_id(), spec, clock_()));
}

grpc::Status KvStoreService::Append(grpc::ServerContext*, const AppendRequest* req,
                                    AppendResponse* resp) {
  if (req->staged_bytes() != 0) {
    return ToGrpcStatus(
        absl::InvalidArgumentError("staged rows come with AppendBatch and its staging_file"));
  }
  if (req->k().size() != req->v().size()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("k has ", req->k().size(), " bytes but v has ", req->v().size())));
  }
  return AppendRows(*req, reinterpret_cast<const uint8_t*>(req->k().data()),
                    reinterpret_cast<const uint8_t*>(req->v().data()), req->k().size(), resp);
}

grpc::Status KvStoreService::AppendRows(const AppendRequest& req, const uint8_t* k,
                                        const uint8_t* v, size_t bytes, AppendResponse* resp) {
  if (req.num_tokens() <= 0 || req.num_tokens() > (int64_t{1} << 24)) {
    return ToGrpcStatus(absl::InvalidArgumentError("num_tokens must be in [1, 2^24]"));
  }
  auto spec = store_.Spec(req.sequence_id());
  if (!spec.ok()) return ToGrpcStatus(spec.status());
  // Checked here too, before the slots are sized from num_tokens.
  const int64_t rows = req.num_tokens() * spec->num_kv_heads;
  if (bytes != static_cast<size_t>(rows * spec->row_bytes())) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "k and v must hold ", req.num_tokens(), " tokens x ", spec->num_kv_heads, " KV heads x ",
        spec->row_bytes(), " bytes = ", rows * spec->row_bytes(), " bytes each; got ", bytes)));
  }
  std::vector<int32_t> slots(static_cast<size_t>(rows));
  absl::Status st = store_.Append(req.sequence_id(), static_cast<int>(req.layer()), req.start(),
                                  req.num_tokens(), k, v, bytes, slots.data(),
                                  std::span<const int32_t>(req.slots().data(), req.slots().size()));
  if (!st.ok()) return ToGrpcStatus(st);
  resp->mutable_slots()->Add(slots.begin(), slots.end());
  return grpc::Status::OK;
}

grpc::Status KvStoreService::AppendBatch(grpc::ServerContext*, const AppendBatchRequest* req,
                                         AppendBatchResponse* resp) {
  // The caller's staging file, mapped (the whole call fails for one the store cannot read).
  if (!req->released_staging_file().empty()) staging_.Release(req->released_staging_file());
  std::shared_ptr<const StagingMapping> staging;
  if (!req->staging_file().empty()) {
    absl::StatusOr<std::shared_ptr<const StagingMapping>> m = staging_.Map(req->staging_file());
    if (!m.ok()) return ToGrpcStatus(m.status());
    staging = *std::move(m);
  }
  std::optional<std::span<const uint8_t>> staged;
  if (staging != nullptr) staged.emplace(staging->data(), staging->size());
  ApplyAppendBatch(*req, staged, "staging file", resp);
  return grpc::Status::OK;
}

absl::StatusOr<std::string> KvStoreService::AppendBatchWithRows(std::span<const uint8_t> request,
                                                                std::span<const uint8_t> rows) {
  AppendBatchRequest req;
  if (!req.ParseFromArray(request.data(), static_cast<int>(request.size()))) {
    return absl::InvalidArgumentError(absl::StrCat("the append message's first ", request.size(),
                                                   " bytes are not an AppendBatchRequest"));
  }
  if (!req.staging_file().empty() || !req.released_staging_file().empty()) {
    return absl::InvalidArgumentError(
        "an append message carries its rows after its request: it names no staging file");
  }
  AppendBatchResponse resp;
  ApplyAppendBatch(req, rows, "message", &resp);
  return resp.SerializeAsString();
}

void KvStoreService::ApplyAppendBatch(const AppendBatchRequest& req,
                                      std::optional<std::span<const uint8_t>> staged,
                                      const char* where, AppendBatchResponse* resp) {
  // One append: its rows from the staged place or from its own bytes.
  auto append = [&](const AppendRequest& a, AppendResponse* one) {
    if (a.staged_bytes() == 0) return Append(nullptr, &a, one);
    if (!staged) {
      return ToGrpcStatus(
          absl::InvalidArgumentError(absl::StrCat("staged rows without a ", where)));
    }
    const uint64_t at = static_cast<uint64_t>(a.staged_offset());
    const uint64_t bytes = static_cast<uint64_t>(a.staged_bytes());
    if (a.staged_offset() < 0 || a.staged_bytes() < 0 || !a.k().empty() || !a.v().empty() ||
        bytes > staged->size() / 2 || at > staged->size() - 2 * bytes) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "staged rows [", a.staged_offset(), ", +2 x ", a.staged_bytes(), ") are not inside the ",
          staged->size(), "-byte ", where, " (and k, v must then be empty)")));
    }
    const uint8_t* k = staged->data() + at;
    return AppendRows(a, k, k + bytes, static_cast<size_t>(bytes), one);
  };
  absl::flat_hash_map<uint64_t, int> failed;  // sequence -> index of its failed append
  int applied = 0;
  for (int i = 0; i < req.appends_size(); ++i) {
    const uint64_t seq = req.appends(i).sequence_id();
    AppendFailure* failure = nullptr;
    if (auto it = failed.find(seq); it != failed.end()) {
      failure = resp->add_failures();
      failure->set_code(grpc::StatusCode::FAILED_PRECONDITION);
      failure->set_message(absl::StrCat("not tried: append ", it->second,
                                        " of this batch to sequence ", seq, " failed"));
    } else {
      AppendResponse one;
      const grpc::Status st = append(req.appends(i), &one);
      if (st.ok()) {
        ++applied;
        continue;
      }
      failed.emplace(seq, i);
      failure = resp->add_failures();
      failure->set_code(st.error_code());
      failure->set_message(st.error_message());
    }
    failure->set_index(i);
  }
  resp->set_applied(applied);
}

grpc::Status KvStoreService::Gather(grpc::ServerContext*, const GatherRequest* req,
                                    GatherResponse* resp) {
  std::vector<infinigen::GatherItem> items;
  std::vector<int64_t> row_bytes;
  size_t reply_bytes = 0;
  for (const auto& it : req->items()) {
    auto spec = store_.Spec(it.sequence_id());
    if (!spec.ok()) return ToGrpcStatus(spec.status());
    row_bytes.push_back(spec->row_bytes());
    reply_bytes += 2 * static_cast<size_t>(it.slots_size()) * static_cast<size_t>(row_bytes.back());
  }
  if (reply_bytes > kMaxKvMessageBytes) {
    return ToGrpcStatus(absl::ResourceExhaustedError(
        absl::StrCat("the gathered rows would take ", reply_bytes, " bytes, over the ",
                     kMaxKvMessageBytes, "-byte message limit: gather fewer rows per call")));
  }
  for (int i = 0; i < req->items_size(); ++i) {
    const auto& it = req->items(i);
    auto* result = resp->add_results();
    const size_t bytes = static_cast<size_t>(it.slots_size()) * row_bytes[i];
    result->mutable_k()->resize(bytes);
    result->mutable_v()->resize(bytes);
    items.push_back({it.sequence_id(), static_cast<int>(it.layer()), it.count(),
                     std::span<const int32_t>(it.slots().data(), it.slots_size()),
                     reinterpret_cast<uint8_t*>(result->mutable_k()->data()),
                     reinterpret_cast<uint8_t*>(result->mutable_v()->data())});
    items.back().row_bytes = row_bytes[i];  // the sizes above, checked under the gather's lock
  }
  absl::Status st = store_.Gather(items);
  if (!st.ok()) {
    resp->Clear();
    return ToGrpcStatus(st);
  }
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Attach(grpc::ServerContext*, const AttachRequest* req,
                                    AttachResponse* resp) {
  resp->set_instance(instance_);
  auto spec = SpecOf(*req);
  if (!spec.ok()) return ToGrpcStatus(spec.status());
  auto length = req->fork() ? store_.Fork(req->from_sequence_id(), req->sequence_id(), *spec,
                                          req->max_length(), clock_())
                            : store_.Attach(req->from_sequence_id(), req->sequence_id(), *spec,
                                            req->max_length(), clock_());
  if (!length.ok()) return ToGrpcStatus(length.status());
  resp->set_length(*length);
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Close(grpc::ServerContext*, const CloseRequest* req, CloseResponse*) {
  return ToGrpcStatus(store_.Close(req->sequence_id()));
}

grpc::Status KvStoreService::Release(grpc::ServerContext*, const ReleaseRequest* req,
                                     ReleaseResponse*) {
  return ToGrpcStatus(store_.Release(req->sequence_id(), clock_()));
}

grpc::Status KvStoreService::Renew(grpc::ServerContext*, const RenewRequest* req,
                                   RenewResponse* resp) {
  resp->set_sequences(store_.Renew(req->owner(), clock_()));
  resp->set_lease_ms(absl::ToInt64Milliseconds(store_.config().lease));
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Stats(grpc::ServerContext*, const StatsRequest*, StatsResponse* r) {
  const KvStoreStats s = store_.Stats();
  r->set_sequences(s.sequences);
  r->set_bytes_capacity(s.bytes_capacity);
  r->set_bytes_used(s.bytes_used);
  r->set_tokens_stored(s.tokens_stored);
  r->set_appends(s.appends);
  r->set_gathers(s.gathers);
  r->set_bytes_gathered(s.bytes_gathered);
  r->set_evictions(s.evictions);
  r->set_rejections(s.rejections);
  r->set_leases_expired(s.leases_expired);
  r->set_block_bytes(s.block_bytes);
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Describe(grpc::ServerContext*, const DescribeRequest*,
                                      DescribeResponse* r) {
  const Arena& a = store_.arena();
  r->set_shm_path(a.share_path());
  r->set_arena_bytes(static_cast<int64_t>(a.num_blocks() * a.block_bytes()));
  r->set_block_bytes(static_cast<int64_t>(a.block_bytes()));
  r->set_ucx_port(ucx_port_.load());
  r->set_ucx_appends(ucx_appends_.load());
  r->set_instance(instance_);
  r->set_staging_dir(staging_.dir());
  return grpc::Status::OK;
}

grpc::Status KvStoreService::Blocks(grpc::ServerContext*, const BlocksRequest* req,
                                    BlocksResponse* r) {
  auto b = store_.Blocks(req->sequence_id(), static_cast<int>(req->layer()));
  if (!b.ok()) return ToGrpcStatus(b.status());
  r->set_rows(b->rows);
  r->set_row_bytes(b->row_bytes);
  r->set_blocks_per_head(b->k_blocks.empty() ? 0 : static_cast<int64_t>(b->k_blocks[0].size()));
  r->set_instance(instance_);
  for (const auto& h : b->k_blocks) r->mutable_k_blocks()->Add(h.begin(), h.end());
  for (const auto& h : b->v_blocks) r->mutable_v_blocks()->Add(h.begin(), h.end());
  return grpc::Status::OK;
}

}  // namespace infinigen
