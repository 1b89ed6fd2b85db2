#include "decode/step/stall_guard.h"

#include "gtest/gtest.h"

namespace fluxion::decode {
namespace {

TEST(StallGuardTest, DisabledKeepsTheWholeBudget) {
  StallGuard guard(StallGuardOptions{});
  guard.Observe(10.0, 1.0);
  EXPECT_EQ(guard.scale(), 1.0);
  EXPECT_EQ(guard.degraded_steps(), 0);
}

TEST(StallGuardTest, ALateCpuShrinksTheBudgetToMeetTheSlackAndNotBelowTheFloor) {
  StallGuardOptions o;
  o.enabled = true;
  StallGuard guard(o);
  guard.Observe(1.1, 1.0);  // within the 20% slack: nothing changes
  EXPECT_EQ(guard.scale(), 1.0);
  guard.Observe(2.0, 1.0);  // 2x the device: the scale that would take it to 1.2x
  EXPECT_DOUBLE_EQ(guard.scale(), 0.6);
  guard.Observe(10.0, 1.0);  // far late: the floor
  EXPECT_DOUBLE_EQ(guard.scale(), o.min_scale);
  EXPECT_EQ(guard.degraded_steps(), 1);  // the step after the first cut ran degraded
}

TEST(StallGuardTest, AnEarlyCpuRecoversGraduallyUpToTheWholeBudget) {
  StallGuardOptions o;
  o.enabled = true;
  StallGuard guard(o);
  guard.Observe(10.0, 1.0);
  ASSERT_DOUBLE_EQ(guard.scale(), 0.4);
  guard.Observe(0.5, 1.0);  // half the device's time: at most 1.25x per step
  EXPECT_DOUBLE_EQ(guard.scale(), 0.5);
  guard.Observe(0.9, 1.0);  // early by 10%: grows by 1/0.9
  EXPECT_NEAR(guard.scale(), 0.5 / 0.9, 1e-12);
  for (int i = 0; i < 10; ++i) guard.Observe(0.1, 1.0);
  EXPECT_EQ(guard.scale(), 1.0);
  guard.Observe(0.0, 1.0);  // a step with no CPU work changes nothing
  EXPECT_EQ(guard.scale(), 1.0);
}

TEST(StallGuardTest, OptionsAreValidated) {
  StallGuardOptions o;
  EXPECT_TRUE(ValidateStallGuardOptions(o).ok());
  o.min_scale = 0;
  EXPECT_EQ(ValidateStallGuardOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.slack = -0.1;
  EXPECT_EQ(ValidateStallGuardOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.recovery = 0.5;
  EXPECT_EQ(ValidateStallGuardOptions(o).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::decode
