// gRPC credentials from TLS files: every service serves TLS when given a certificate and key,
// and requires client certificates (mTLS) when also given a CA; internal clients use TLS when
// given the CA that signed their server and present their own certificate when they have one.
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>

#include "absl/status/statusor.h"
#include "common/tls_files.h"

namespace infinigen {

// Insecure when `files` names no certificate; `files.ca` is the client CA (mTLS). INVALID_ARGUMENT
// naming the flag `prefix` + cert, key or client_ca when a file is missing or not PEM, or only
// one of cert and key is given.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, const std::string& prefix = "--tls_");

// Insecure when `files.ca` is empty; errors name `prefix` + cert, key or ca.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files, const std::string& prefix = "--tls_");

}  // namespace infinigen
