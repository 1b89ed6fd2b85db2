#include "cluster/backend_health.h"

#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

HealthHysteresis Make(int n, int m) {
  HealthHysteresisOptions o;
  o.failures_to_eject = n;
  o.successes_to_admit = m;
  return HealthHysteresis(o);
}

TEST(HealthHysteresisTest, ANewNodeJoinsOnItsFirstPass) {
  HealthHysteresis h = Make(3, 2);
  EXPECT_EQ(h.state(), HealthState::kNew);
  EXPECT_FALSE(h.routable());
  h.Observe(false);  // still starting: no history, not routed to, not an ejection
  EXPECT_EQ(h.state(), HealthState::kNew);
  h.Observe(true);
  EXPECT_EQ(h.state(), HealthState::kHealthy);
  EXPECT_TRUE(h.routable());
  EXPECT_EQ(h.ejections(), 0);
}

TEST(HealthHysteresisTest, DroppedOnlyAfterNMissesInARow) {
  HealthHysteresis h = Make(3, 2);
  h.Observe(true);
  h.Observe(false);
  EXPECT_EQ(h.state(), HealthState::kSuspect);
  EXPECT_TRUE(h.routable());
  h.Observe(false);
  EXPECT_TRUE(h.routable());
  EXPECT_EQ(h.consecutive_failures(), 2);
  h.Observe(true);  // a pass resets the run: two more misses do not drop it
  EXPECT_EQ(h.state(), HealthState::kHealthy);
  h.Observe(false);
  h.Observe(false);
  EXPECT_TRUE(h.routable());
  h.Observe(false);
  EXPECT_EQ(h.state(), HealthState::kEjected);
  EXPECT_FALSE(h.routable());
  EXPECT_EQ(h.ejections(), 1);
}

TEST(HealthHysteresisTest, TakenBackOnlyAfterMPassesInARow) {
  HealthHysteresis h = Make(1, 3);
  h.Observe(true);
  h.Observe(false);
  ASSERT_EQ(h.state(), HealthState::kEjected);
  h.Observe(true);
  h.Observe(true);
  EXPECT_EQ(h.state(), HealthState::kRecovering);
  EXPECT_FALSE(h.routable());
  h.Observe(false);  // a miss while recovering starts the count again
  EXPECT_EQ(h.state(), HealthState::kEjected);
  h.Observe(true);
  h.Observe(true);
  EXPECT_FALSE(h.routable());
  h.Observe(true);
  EXPECT_EQ(h.state(), HealthState::kHealthy);
  EXPECT_EQ(h.ejections(), 1);  // recovering and failing again is not a second ejection
}

TEST(HealthHysteresisTest, OneAndOneIsTheOldBehaviour) {
  HealthHysteresis h = Make(1, 1);
  h.Observe(true);
  h.Observe(false);
  EXPECT_FALSE(h.routable());
  h.Observe(true);
  EXPECT_TRUE(h.routable());
}

TEST(HealthHysteresisTest, EjectDropsARoutedNodeAtOnce) {
  HealthHysteresis h = Make(5, 2);
  h.Eject();  // never seen healthy: stays new, counts no ejection
  EXPECT_EQ(h.state(), HealthState::kNew);
  EXPECT_EQ(h.ejections(), 0);
  h.Observe(true);
  h.Eject();
  EXPECT_EQ(h.state(), HealthState::kEjected);
  EXPECT_EQ(h.ejections(), 1);
  h.Eject();
  EXPECT_EQ(h.ejections(), 1);
  h.Observe(true);
  EXPECT_EQ(h.state(), HealthState::kRecovering);
  h.Observe(true);
  EXPECT_EQ(h.state(), HealthState::kHealthy);
}

TEST(HealthHysteresisTest, CountsOutsideOneToAHundredAreRejected) {
  EXPECT_TRUE(ValidateHealthHysteresis({}).ok());
  for (auto [n, m] : {std::pair{0, 2}, std::pair{3, 0}, std::pair{101, 1}, std::pair{-1, 1}}) {
    HealthHysteresisOptions o;
    o.failures_to_eject = n;
    o.successes_to_admit = m;
    absl::Status s = ValidateHealthHysteresis(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << n << "," << m;
    EXPECT_NE(s.message().find("--health-"), std::string::npos) << s;
  }
}

TEST(HealthHysteresisTest, StateNames) {
  EXPECT_STREQ(HealthStateName(HealthState::kSuspect), "suspect");
  EXPECT_STREQ(HealthStateName(HealthState::kRecovering), "recovering");
}

}  // namespace
}  // namespace fluxion::cluster
