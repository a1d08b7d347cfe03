// MetricsExposer over real sockets on 127.0.0.1: GET /metrics serves every registered
// collectable in the Prometheus text format, read at each scrape; other paths and methods get
// 404 / 405; a client that connects and sends nothing delays the next scrape by at most the
// client timeout; a port in use is refused with a clear error; it starts with a large static TLS
// (the reason it exists: civetweb's threads could not start in such a process).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>

#include "common/metrics/exposer.h"
#include "common/metrics/family.h"
#include "tests/support/http_get.h"

namespace infinigen {
namespace {

using testing::HttpGet;
using testing::HttpRequest;
using testing::MetricValue;

class ValueCollectable final : public prometheus::Collectable {
 public:
  explicit ValueCollectable(const double* value) : value_(value) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    return {MetricFamilyOf("test_value", "A value read at each scrape",
                           prometheus::MetricType::Gauge, *value_)};
  }

 private:
  const double* value_;
};

TEST(MetricsExposer, ServesRegisteredCollectablesReadAtEachScrape) {
  auto exposer = MetricsExposer::Start(0);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  double value = 7;
  (*exposer)->Register(std::make_shared<ValueCollectable>(&value));
  auto registry = std::make_shared<prometheus::Registry>();
  auto& counter = prometheus::BuildCounter()
                      .Name("test_events_total")
                      .Help("Events")
                      .Register(*registry)
                      .Add({{"kind", "a"}});
  (*exposer)->Register(registry);
  counter.Increment(3);

  testing::HttpReply r = HttpGet((*exposer)->port(), "/metrics");
  ASSERT_EQ(r.code, 200);
  EXPECT_EQ(MetricValue(r.body, "test_value"), 7);
  EXPECT_EQ(MetricValue(r.body, "test_events_total"), 3);
  EXPECT_NE(r.body.find("# TYPE test_value gauge"), std::string::npos) << r.body;

  value = 11;
  counter.Increment();
  r = HttpGet((*exposer)->port(), "/metrics?format=text");
  ASSERT_EQ(r.code, 200);
  EXPECT_EQ(MetricValue(r.body, "test_value"), 11);
  EXPECT_EQ(MetricValue(r.body, "test_events_total"), 4);
}

TEST(MetricsExposer, OtherPathsAndMethodsAreRefused) {
  auto exposer = MetricsExposer::Start(0);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  EXPECT_EQ(HttpGet((*exposer)->port(), "/").code, 404);
  EXPECT_EQ(HttpGet((*exposer)->port(), "/metricsx").code, 404);
  EXPECT_EQ(HttpRequest((*exposer)->port(), "POST", "/metrics").code, 405);
  const testing::HttpReply head = HttpRequest((*exposer)->port(), "HEAD", "/metrics");
  EXPECT_EQ(head.code, 200);
  EXPECT_TRUE(head.body.empty());
}

TEST(MetricsExposer, SilentClientDelaysTheNextScrapeOnlyUntilItsTimeout) {
  auto exposer = MetricsExposer::Start(0);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>((*exposer)->port()));
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(HttpGet((*exposer)->port(), "/metrics").code, 200);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8));
  ::close(fd);
}

TEST(MetricsExposer, PortInUseIsRefusedWithTheReason) {
  auto first = MetricsExposer::Start(0);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MetricsExposer::Start((*first)->port());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find("in use"), std::string::npos) << second.status();
  EXPECT_EQ(MetricsExposer::Start(70000).status().code(), absl::StatusCode::kInvalidArgument);
}

// A thread-local block larger than civetweb's 100 KiB thread stacks, in this process's static
// TLS, as cuBLASLt and OpenBLAS put there in the worker.
thread_local char big_tls[256 << 10];

TEST(MetricsExposer, ServesInAProcessWithALargeStaticTls) {
  big_tls[0] = 1;
  auto exposer = MetricsExposer::Start(0);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  EXPECT_EQ(HttpGet((*exposer)->port(), "/metrics").code, 200);
}

}  // namespace
}  // namespace infinigen
