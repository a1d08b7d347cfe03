// Constructors of the KvStoreClient transports (MakeKvStoreClient, client_factory.cc, picks
// among them; the remote ones exist only in builds with gRPC, the UCX data plane only with UCX).
#pragma once

#include <memory>

#include "kv_store/client/kv_store_client.h"

namespace infinigen {

class KvControlPlane;
class KvDataPlane;

absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeInProcessClient(const KvClientConfig& config);

// A store in another process: the gRPC control plane (control_plane.h) and the data plane
// `make` builds (data_plane.h).
using DataPlaneMaker = std::unique_ptr<KvDataPlane> (*)(KvControlPlane& control,
                                                        const KvClientConfig& config);
absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeRemoteClient(const KvClientConfig& config,
                                                                DataPlaneMaker make);
std::unique_ptr<KvDataPlane> MakeGrpcDataPlane(KvControlPlane& control,
                                               const KvClientConfig& config);
std::unique_ptr<KvDataPlane> MakeShmDataPlane(KvControlPlane& control,
                                              const KvClientConfig& config);
std::unique_ptr<KvDataPlane> MakeUcxDataPlane(KvControlPlane& control,
                                              const KvClientConfig& config);

}  // namespace infinigen
