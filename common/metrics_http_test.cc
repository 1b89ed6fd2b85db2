#include "common/metrics_http.h"

#include "common/metrics_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::metrics {
namespace {

using ::testing::HasSubstr;

// One server (and registry) for the suite.
class MetricsHttpServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    registry_ = new Registry();
    registry_->AddCounter("fluxion_test_requests_total", "Requests by code.", {{"code", "OK"}})
        ->Increment(2);
    registry_->AddGauge("fluxion_test_requests_running", "Running requests.")->Set(3);
    registry_->AddGaugeCallback("fluxion_test_kv_pages_free", "Free KV pages.", {},
                                [] { return 7; });
    registry_->AddHistogram("fluxion_test_time_to_first_token_seconds", "TTFT.",
                            LatencyBuckets())
        ->Observe(0.2);
    auto server = MetricsHttpServer::Start("127.0.0.1:0", registry_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete registry_;
  }
  static Registry* registry_;
  static MetricsHttpServer* server_;
};
Registry* MetricsHttpServerTest::registry_ = nullptr;
MetricsHttpServer* MetricsHttpServerTest::server_ = nullptr;

TEST_F(MetricsHttpServerTest, ServesTheRegistryAtMetricsOnAPickedPort) {
  ASSERT_GT(server_->port(), 0);
  auto body = testing::HttpGet(server_->port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_THAT(*body, HasSubstr("fluxion_test_requests_total{code=\"OK\"} 2\n"));
  EXPECT_THAT(*body, HasSubstr("fluxion_test_kv_pages_free 7\n"));
  EXPECT_FALSE(testing::HttpGet(server_->port(), "/other").ok());
}

TEST_F(MetricsHttpServerTest, BusyPortIsUnavailable) {
  auto second = MetricsHttpServer::Start("127.0.0.1:" + std::to_string(server_->port()), registry_);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(MetricsHttpServerTest, PromtoolAcceptsEveryMetricType) {
  if (!testing::HavePromtool()) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  auto body = testing::HttpGet(server_->port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  absl::Status check = testing::PromtoolCheck(*body);
  EXPECT_TRUE(check.ok()) << check << "\n" << *body;
}

TEST_F(MetricsHttpServerTest, PromtoolRejectsABrokenExposition) {
  if (!testing::HavePromtool()) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  // Guards the check itself: a counter without _total and without HELP must fail the lint.
  EXPECT_FALSE(testing::PromtoolCheck("# TYPE requests counter\nrequests 1\n").ok());
}

}  // namespace
}  // namespace fluxion::metrics
