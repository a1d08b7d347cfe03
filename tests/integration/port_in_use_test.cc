// A service binary started on a port another server holds fails to start and says why, and the
// server holding the port serves on. gRPC sets SO_REUSEPORT on Linux by default, under which a
// second KV store on a store's port started "serving" and the kernel shared the connections
// between the two (common/grpc/listen.h).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/support/health_check.h"
#include "tests/support/process.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

struct Finished {
  int exit_code;
  std::string output;
};

// Runs `command` (stderr with stdout) to its end, or 30 s: one that started serving is stopped
// there and reported as exit code 124.
Finished RunToEnd(const std::string& command) {
  FILE* p = popen(("timeout 30 " + command + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  std::string out;
  char buf[1024];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(PortInUse, EveryServiceRefusesAPortAnotherServerHolds) {
  const int port = testing::FreePort();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  testing::ServerProcess holder(
      "infinigen-kvstore", {"--listen=" + address, "--capacity_mb=16", "--huge_pages=false"}, port);
  ASSERT_TRUE(holder.running());
  const std::vector<std::string> commands = {
      testing::BinaryPath("infinigen-kvstore") + " --listen=" + address +
          " --capacity_mb=16 --huge_pages=false",
      testing::BinaryPath("infinigen-worker") + " --model=/no/such/model --listen=" + address,
      testing::BinaryPath("infinigen-router") + " --workers=127.0.0.1:1 --listen=" + address,
  };
  for (const std::string& command : commands) {
    const Finished r = RunToEnd(command);
    EXPECT_NE(r.exit_code, 0) << command << ": " << r.output;
    EXPECT_NE(r.exit_code, 124) << command << " started serving on a port in use: " << r.output;
    EXPECT_NE(r.output.find("cannot listen on " + address + ": the port is in use"),
              std::string::npos)
        << command << ": " << r.output;
  }
  // The holder still answers.
  EXPECT_EQ(testing::CheckHealth(address), grpc::health::v1::HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace infinigen
