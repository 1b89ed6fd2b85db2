#include "common/metrics.h"

#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsTest, CounterRendersHelpTypeAndLabelledSeries) {
  Registry registry;
  registry.AddCounter("fluxion_test_requests_total", "Requests.", {{"code", "OK"}})->Increment(3);
  registry.AddCounter("fluxion_test_requests_total", "Requests.", {{"code", "UNAVAILABLE"}})
      ->Increment();
  EXPECT_EQ(registry.Render(),
            "# HELP fluxion_test_requests_total Requests.\n"
            "# TYPE fluxion_test_requests_total counter\n"
            "fluxion_test_requests_total{code=\"OK\"} 3\n"
            "fluxion_test_requests_total{code=\"UNAVAILABLE\"} 1\n");
}

TEST(MetricsTest, AddReturnsTheSameMetricForTheSameNameAndLabelsInAnyOrder) {
  Registry registry;
  Counter* a = registry.AddCounter("x_total", "h", {{"a", "1"}, {"b", "2"}});
  Counter* b = registry.AddCounter("x_total", "h", {{"b", "2"}, {"a", "1"}});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, registry.AddCounter("x_total", "h", {{"a", "1"}, {"b", "3"}}));
}

TEST(MetricsTest, CountersIgnoreNegativeDeltas) {
  Counter c;
  c.Increment(2);
  c.Increment(-5);
  EXPECT_EQ(c.value(), 2);
}

TEST(MetricsTest, HistogramBucketsAreCumulativeLessOrEqualWithInfAndCount) {
  Registry registry;
  Histogram* h = registry.AddHistogram("lat_seconds", "Latency.", {0.1, 1});
  h->Observe(0.05);
  h->Observe(0.1);  // le="0.1" includes the bound
  h->Observe(0.5);
  h->Observe(7);
  EXPECT_EQ(registry.Render(),
            "# HELP lat_seconds Latency.\n"
            "# TYPE lat_seconds histogram\n"
            "lat_seconds_bucket{le=\"0.1\"} 2\n"
            "lat_seconds_bucket{le=\"1\"} 3\n"
            "lat_seconds_bucket{le=\"+Inf\"} 4\n"
            "lat_seconds_sum 7.65\n"
            "lat_seconds_count 4\n");
}

TEST(MetricsTest, LabelValuesAndHelpAreEscaped) {
  Registry registry;
  registry.AddGauge("g", "line1\nback\\slash", {{"peer", "a\"b\\c\nd"}})->Set(1);
  std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("# HELP g line1\\nback\\\\slash\n"));
  EXPECT_THAT(text, HasSubstr("g{peer=\"a\\\"b\\\\c\\nd\"} 1\n"));
}

TEST(MetricsTest, GaugeCallbackIsReadAtRenderTime) {
  Registry registry;
  double pages = 5;
  registry.AddGaugeCallback("pages_free", "Free pages.", {}, [&] { return pages; });
  EXPECT_THAT(registry.Render(), HasSubstr("pages_free 5\n"));
  pages = 9;
  EXPECT_THAT(registry.Render(), HasSubstr("pages_free 9\n"));
}

TEST(MetricsTest, CounterCallbackIsReadAtRenderTimeAsACounter) {
  Registry registry;
  uint64_t sent = 3;
  registry.AddCounterCallback("bytes_total", "Bytes.", {{"direction", "sent"}},
                              [&] { return static_cast<double>(sent); });
  EXPECT_THAT(registry.Render(), HasSubstr("# TYPE bytes_total counter\n"));
  EXPECT_THAT(registry.Render(), HasSubstr("bytes_total{direction=\"sent\"} 3\n"));
  sent = 70;
  EXPECT_THAT(registry.Render(), HasSubstr("bytes_total{direction=\"sent\"} 70\n"));
}

TEST(MetricsTest, RemoveDropsTheSeriesAndAnEmptyFamily) {
  Registry registry;
  registry.AddGaugeCallback("free", "Free.", {{"a", "1"}}, [] { return 1.0; });
  registry.AddGaugeCallback("free", "Free.", {{"a", "2"}}, [] { return 2.0; });
  registry.Remove("free", {{"a", "1"}});
  std::string text = registry.Render();
  EXPECT_THAT(text, Not(HasSubstr("free{a=\"1\"}")));
  EXPECT_THAT(text, HasSubstr("free{a=\"2\"} 2\n"));
  registry.Remove("free", {{"a", "2"}});
  registry.Remove("never_registered");
  EXPECT_EQ(registry.Render(), "");
}

TEST(MetricsTest, ValuesUseShortestRoundTripAndPrometheusSpecials) {
  EXPECT_EQ(FormatValue(0.005), "0.005");
  EXPECT_EQ(FormatValue(12345678), "12345678");
  EXPECT_EQ(FormatValue(10), "10");
  EXPECT_EQ(FormatValue(-3), "-3");
  EXPECT_EQ(FormatValue(2.5), "2.5");
  EXPECT_EQ(FormatValue(1e20), "1e+20");
  EXPECT_EQ(FormatValue(1.0 / 0.0), "+Inf");
  EXPECT_EQ(FormatValue(-1.0 / 0.0), "-Inf");
  EXPECT_EQ(FormatValue(0.0 / 0.0), "NaN");
}

TEST(MetricsTest, ConcurrentUpdatesAreNotLost) {
  Registry registry;
  Counter* c = registry.AddCounter("c_total", "h");
  Gauge* g = registry.AddGauge("g", "h");
  Histogram* h = registry.AddHistogram("h_seconds", "h", LatencyBuckets());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        c->Increment();
        g->Add(1);
        h->Observe(0.003);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c->value(), 80000);
  EXPECT_EQ(g->value(), 80000);
  EXPECT_EQ(h->Read().cumulative.back(), 80000u);
  EXPECT_NEAR(h->Read().sum, 240, 1e-6);
}

TEST(MetricsDeathTest, CounterWithoutTotalSuffixIsABug) {
  Registry registry;
  EXPECT_DEATH(registry.AddCounter("requests", "h"), "must end in _total");
}

TEST(MetricsDeathTest, OneNameWithTwoTypesIsABug) {
  Registry registry;
  registry.AddGauge("x", "h");
  EXPECT_DEATH(registry.AddHistogram("x", "h", {1}), "two types");
}

}  // namespace
}  // namespace fluxion::metrics
