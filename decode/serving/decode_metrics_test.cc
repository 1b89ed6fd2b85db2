#include "decode/serving/decode_metrics.h"

#include <string>

#include "common/metrics.h"
#include "gtest/gtest.h"

namespace fluxion::decode {
namespace {

// The error guard's view in /metrics: a histogram of checked-head errors and the count of budget
// escalations (and relaxations, checks and the checks' rows).
TEST(DecodeMetricsTest, ExportsTheGuardsCheckedErrorsAndEscalations) {
  metrics::Registry registry;
  DecodeNodeMetrics m(&registry, DecodeMetricsConfig{});
  FinishedRequestStats r;
  r.policy = "fluxion";
  r.guard.checks = 3;
  r.guard.check_rows = 3000;
  r.guard.escalations = 2;
  r.guard.relaxations = 1;
  r.guard.reverts = 4;
  r.guard.errors = {0.004, 0.04, 0.3};
  m.OnFinished(r);
  const std::string text = registry.Render();
  EXPECT_NE(text.find("fluxion_sparse_guard_error_bucket{le=\"0.005\"} 1"), std::string::npos)
      << text;
  EXPECT_NE(text.find("fluxion_sparse_guard_error_bucket{le=\"0.05\"} 2"), std::string::npos);
  EXPECT_NE(text.find("fluxion_sparse_guard_error_count 3"), std::string::npos);
  EXPECT_NE(text.find("fluxion_sparse_guard_checks_total 3"), std::string::npos);
  EXPECT_NE(text.find("fluxion_sparse_guard_adjustments_total{direction=\"escalation\"} 2"),
            std::string::npos);
  EXPECT_NE(text.find("fluxion_sparse_guard_adjustments_total{direction=\"relaxation\"} 1"),
            std::string::npos);
  EXPECT_NE(text.find("fluxion_sparse_guard_adjustments_total{direction=\"revert\"} 4"),
            std::string::npos);
  EXPECT_NE(text.find("fluxion_sparse_rows_total{kind=\"guard_check\"} 3000"), std::string::npos);
}

}  // namespace
}  // namespace fluxion::decode
