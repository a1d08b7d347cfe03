// Per-API-key limits of the router (router/key_limits.h): streams in flight and a token bucket
// of requests per second, with explicit times (no sleeping), and the flags' validation.
#include "router/key_limits.h"

#include <gtest/gtest.h>

namespace infinigen {
namespace {

TEST(KeyLimits, StreamsInFlightPerKey) {
  KeyLimitsConfig config;
  config.max_streams = 2;
  KeyLimits limits(config, 2);
  const absl::Time t = absl::FromUnixSeconds(1000);
  absl::Duration retry;
  EXPECT_TRUE(limits.Enter(0, t, &retry).ok());
  EXPECT_TRUE(limits.Enter(0, t, &retry).ok());
  const absl::Status third = limits.Enter(0, t, &retry);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.message().find("max_streams_per_key"), std::string::npos) << third;
  EXPECT_GT(retry, absl::ZeroDuration());
  EXPECT_TRUE(limits.Enter(1, t, &retry).ok()) << "another key has its own";
  limits.Leave(0);
  EXPECT_EQ(limits.streams(0), 1);
  EXPECT_TRUE(limits.Enter(0, t, &retry).ok()) << "a stream ended: room again";
  EXPECT_EQ(limits.Enter(5, t, &retry).code(), absl::StatusCode::kInternal);
}

TEST(KeyLimits, RequestsPerSecondWithABurst) {
  KeyLimitsConfig config;
  config.requests_per_second = 2;
  config.burst = 3;
  KeyLimits limits(config, 1);
  absl::Time t = absl::FromUnixSeconds(1000);
  absl::Duration retry;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(limits.Enter(0, t, &retry).ok()) << "the burst, request " << i;
    limits.Leave(0);
  }
  const absl::Status over = limits.Enter(0, t, &retry);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("requests_per_second_per_key"), std::string::npos) << over;
  EXPECT_EQ(retry, absl::Milliseconds(500)) << "one token comes back in 1/2 s";
  t += absl::Milliseconds(400);
  EXPECT_FALSE(limits.Enter(0, t, &retry).ok());
  EXPECT_EQ(retry, absl::Milliseconds(100));
  t += absl::Milliseconds(100);
  EXPECT_TRUE(limits.Enter(0, t, &retry).ok()) << "refilled";
  limits.Leave(0);
  t += absl::Seconds(60);  // a long pause refills to the burst, not beyond
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(limits.Enter(0, t, &retry).ok());
    limits.Leave(0);
  }
  EXPECT_FALSE(limits.Enter(0, t, &retry).ok());
}

TEST(KeyLimits, WithoutABurstOneSecondsWorth) {
  KeyLimitsConfig config;
  config.requests_per_second = 0.5;  // a request every 2 s, bursts of 1
  KeyLimits limits(config, 1);
  const absl::Time t = absl::FromUnixSeconds(1000);
  absl::Duration retry;
  EXPECT_TRUE(limits.Enter(0, t, &retry).ok());
  EXPECT_FALSE(limits.Enter(0, t + absl::Seconds(1), &retry).ok());
  EXPECT_EQ(retry, absl::Seconds(1));
  EXPECT_TRUE(limits.Enter(0, t + absl::Seconds(2), &retry).ok());
}

TEST(KeyLimits, FlagsAreValidated) {
  KeyLimitsConfig config;
  EXPECT_TRUE(config.Validate().ok());
  EXPECT_FALSE(config.any());
  config.max_streams = -1;
  EXPECT_EQ(config.Validate().code(), absl::StatusCode::kInvalidArgument);
  config.max_streams = 0;
  config.requests_per_second = -2;
  EXPECT_NE(config.Validate().message().find("requests_per_second_per_key"), std::string::npos);
  config.requests_per_second = 1;
  config.burst = -1;
  EXPECT_NE(config.Validate().message().find("request_burst_per_key"), std::string::npos);
}

}  // namespace
}  // namespace infinigen
