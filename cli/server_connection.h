// How the `client` and `load` commands reach a server: --server, TLS files and an API key
// (--api-key or $INFINIGEN_API_KEY), and waiting for the server to come up.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cli/flags.h"
#include "common/tls_files.h"

namespace infinigen::cli {

struct ConnectionFlags {
  std::string server = "127.0.0.1:50051";
  std::string api_key;
  TlsFiles tls;  // ca turns TLS on; cert/key for mTLS
  double wait_seconds = 0;

  void Register(FlagSet& flags);
  // A channel that is ready (health SERVING) within --wait-seconds, or UNAVAILABLE.
  absl::StatusOr<std::shared_ptr<grpc::Channel>> Connect() const;
  // Adds the API key to a call.
  void Authorize(grpc::ClientContext& context) const;
};

}  // namespace infinigen::cli
