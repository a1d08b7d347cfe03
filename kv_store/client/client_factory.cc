// Picks a KvStoreClient transport: the one place that knows which this build has (the remote
// ones only with the services, UCX only with libucx).
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
#if INFINIGEN_HAVE_GRPC_TRANSPORT
    case KvClientConfig::Transport::kGrpc:
      return MakeRemoteClient(config, MakeGrpcDataPlane);
    case KvClientConfig::Transport::kShm:
      return MakeRemoteClient(config, MakeShmDataPlane);
    case KvClientConfig::Transport::kUcx:
#if INFINIGEN_HAVE_UCX
      return MakeRemoteClient(config, MakeUcxDataPlane);
#else
      return absl::UnimplementedError(
          "this build has no UCX (install libucx-dev and build again, or use --kv_transport grpc)");
#endif
#else
    case KvClientConfig::Transport::kGrpc:
    case KvClientConfig::Transport::kShm:
    case KvClientConfig::Transport::kUcx:
      return absl::UnimplementedError("this build has no gRPC (INFINIGEN_WITH_SERVICES=OFF)");
#endif
  }
  return absl::InvalidArgumentError("unknown transport");
}

}  // namespace infinigen
