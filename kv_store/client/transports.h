// Constructors of the KvStoreClient transports (MakeKvStoreClient picks among them).
#pragma once

#include "kv_store/client/kv_store_client.h"

namespace infinigen {

absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeInProcessClient(const KvClientConfig& config);
// gRPC, and shm (gRPC control, rows copied from the store's shared arena).
absl::StatusOr<std::unique_ptr<KvStoreClient>> MakeGrpcClient(const KvClientConfig& config);

}  // namespace infinigen
