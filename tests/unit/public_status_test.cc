// Internal addresses out of what public clients read (router/public_status.h), as a table.
#include "router/public_status.h"

#include <gtest/gtest.h>

namespace infinigen {
namespace {

TEST(PublicStatus, AddressesAreRedactedAndTheRestKept) {
  const std::pair<const char*, const char*> cases[] = {
      {"failed to connect to all addresses; last error: UNKNOWN: ipv4:10.1.2.3:57193: Failed to "
       "connect to remote host: Connection refused",
       "failed to connect to all addresses; last error: UNKNOWN: <internal>: Failed to connect "
       "to remote host: Connection refused"},
      {"KV store 192.168.0.7:7000 is unreachable", "KV store <internal> is unreachable"},
      {"peer [fe80::1]:50052 reset", "peer <internal> reset"},
      {"target ipv6:[::1]:5 and unix:/run/store.sock, then dns:///kvstore:7000",
       "target <internal> and <internal>, then <internal>"},
      {"version 1.2.3 of 4 layers, 10.5 tokens/s", "version 1.2.3 of 4 layers, 10.5 tokens/s"},
      {"token id 4294967296 is outside [0, 211)", "token id 4294967296 is outside [0, 211)"},
      {"v1.2.3.4 is a name", "v1.2.3.4 is a name"},
      {"", ""},
  };
  for (const auto& [in, want] : cases) EXPECT_EQ(RedactAddresses(in), want) << in;
}

TEST(PublicStatus, ForClientsKeepsTheCode) {
  const grpc::Status s(grpc::StatusCode::UNAVAILABLE, "store at 10.0.0.1:7000 down");
  const grpc::Status out = ForClients(s);
  EXPECT_EQ(out.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(out.error_message(), "store at <internal> down");
  EXPECT_TRUE(ForClients(grpc::Status::OK).ok());
}

}  // namespace
}  // namespace infinigen
