// What the router tells public clients of a failure behind it: the status as it is, with the
// internal addresses that gRPC and the services name in their messages (workers, the KV store:
// "ipv4:10.0.0.5:7000", "failed to connect to 10.0.0.5:50052") replaced by "<internal>", so that
// a client learns what went wrong but not where the cluster's services live. The router logs the
// original.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/strings/string_view.h"

namespace infinigen {

std::string RedactAddresses(absl::string_view message);
grpc::Status ForClients(const grpc::Status& status);

}  // namespace infinigen
