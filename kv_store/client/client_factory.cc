// Picks a KvStoreClient transport. The gRPC-based ones exist only in builds with the services.
#include "absl/strings/str_cat.h"
#include "kv_store/client/transports.h"

namespace infinigen {

absl::StatusOr<KvClientConfig::Transport> ParseTransport(absl::string_view name) {
  if (name == "in-process" || name == "inprocess") return KvClientConfig::Transport::kInProcess;
  if (name == "grpc") return KvClientConfig::Transport::kGrpc;
  if (name == "shm") return KvClientConfig::Transport::kShm;
  if (name == "ucx") return KvClientConfig::Transport::kUcx;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV transport '", name, "': expected in-process, grpc, shm or ucx"));
}

absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeKvStoreClient(const KvClientConfig& config) {
  switch (config.transport) {
    case KvClientConfig::Transport::kInProcess:
      return MakeInProcessClient(config);
    case KvClientConfig::Transport::kGrpc:
    case KvClientConfig::Transport::kShm:
    case KvClientConfig::Transport::kUcx:
#if INFINIGEN_HAVE_GRPC_TRANSPORT
      return MakeGrpcClient(config);
#else
      return absl::UnimplementedError("this build has no gRPC (INFINIGEN_WITH_SERVICES=OFF)");
#endif
  }
  return absl::InvalidArgumentError("unknown transport");
}

}  // namespace infinigen
