// A server's grpc.health.v1 status: the whole server ("") and each service it serves by its full
// name (what `grpc-health-probe -service`, Kubernetes' gRPC probes with `service:` and Envoy
// ask), set together so that no name ever answers NOT_FOUND while the server runs.
#pragma once

#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <initializer_list>
#include <string>

namespace infinigen {

// Serves grpc.health.v1 (Check, and Watch streaming each change) on the server `builder` builds,
// in place of gRPC's default health service, with the server ("") NOT_SERVING until SetHealth
// marks it serving. gRPC's own service answers "" SERVING from the moment the server starts,
// before the process has said it is ready: a worker still loading its model looked ready to a
// probe that came in between.
void AddHealthService(grpc::ServerBuilder& builder);

// Sets "" and each of `services` serving or not (nothing when the server has no health service).
void SetHealth(grpc::Server& server, std::initializer_list<const char*> services, bool serving);

}  // namespace infinigen
