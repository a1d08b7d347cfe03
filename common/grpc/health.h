// A server's grpc.health.v1 status: the whole server ("") and each service it serves by its full
// name (what `grpc-health-probe -service`, Kubernetes' gRPC probes with `service:` and Envoy
// ask), set together so that no name ever answers NOT_FOUND while the server runs.
#pragma once

#include <grpcpp/server.h>

#include <initializer_list>
#include <string>

namespace infinigen {

void SetHealth(grpc::Server& server, std::initializer_list<const char*> services, bool serving);

}  // namespace infinigen
