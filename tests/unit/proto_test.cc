// The generated API code builds and keeps proto3 presence: an unset temperature differs from an
// explicit 0 (greedy), which the servers rely on to apply their defaults.
#include <gtest/gtest.h>

#include "infinigen/v1/sampling.pb.h"

namespace infinigen {
namespace {

TEST(Proto, SamplingParamsRoundTripKeepsPresence) {
  v1::SamplingParams p;
  EXPECT_FALSE(p.has_temperature());
  p.set_temperature(0.0f);
  p.set_top_k(40);
  p.set_seed(7);
  v1::SamplingParams q;
  ASSERT_TRUE(q.ParseFromString(p.SerializeAsString()));
  EXPECT_TRUE(q.has_temperature());
  EXPECT_EQ(q.temperature(), 0.0f);
  EXPECT_EQ(q.top_k(), 40);
  EXPECT_EQ(q.seed(), 7u);
  EXPECT_FALSE(q.has_top_p());
  EXPECT_EQ(v1::FinishReason_Name(v1::FINISH_REASON_STOP), "FINISH_REASON_STOP");
}

}  // namespace
}  // namespace infinigen
