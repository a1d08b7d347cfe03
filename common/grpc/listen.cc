#include "common/grpc/listen.h"

#include <grpc/grpc.h>

#include "absl/strings/str_cat.h"

namespace infinigen {

void Listen(grpc::ServerBuilder& builder, const std::string& address,
            std::shared_ptr<grpc::ServerCredentials> credentials, int* port) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(address, std::move(credentials), port);
}

std::string CannotListen(const std::string& address) {
  return absl::StrCat("cannot listen on ", address,
                      ": the port is in use (another server, or this one still running) or the "
                      "address is not this host's");
}

}  // namespace infinigen
