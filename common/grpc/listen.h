// A service's gRPC port, held alone. gRPC sets SO_REUSEPORT on Linux by default, so a second
// server on a port in use started as if all were well and the kernel shared the connections
// between the two: a KV store restarted while the old one still ran, or two workers given the
// same --listen, answered in turn with different data. Listen makes the second one fail to
// start instead, and says why.
#pragma once

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <memory>
#include <string>

namespace infinigen {

// builder.AddListeningPort(address, credentials, port) with the port not shared.
void Listen(grpc::ServerBuilder& builder, const std::string& address,
            std::shared_ptr<grpc::ServerCredentials> credentials, int* port);

// What to print when the server built with Listen did not start: the address, and the likely
// cause.
std::string CannotListen(const std::string& address);

}  // namespace infinigen
