#include "cluster/replay_stats.h"

#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

RequestRecord Ok(double start, std::vector<double> chunk_times, std::vector<int32_t> tokens) {
  RequestRecord r;
  r.start_s = start;
  r.chunk_times_s = std::move(chunk_times);
  r.chunk_tokens = std::move(tokens);
  for (int32_t n : r.chunk_tokens) r.output_tokens += n;
  r.end_s = r.chunk_times_s.back();
  r.input_tokens = 10;
  return r;
}

// A known schedule, worked out by hand:
//   r0: sent 0.0, tokens at 0.10, 0.12, 0.14, 0.16  -> TTFT 100, E2E 160, TPOT 60/3 = 20, ITL 20 x3
//   r1: sent 1.0, 2 tokens at 1.2, 2 at 1.3          -> TTFT 200, E2E 300, TPOT 100/3, ITL 100
//   r2: sent 0.5, UNAVAILABLE at 0.6
//   r3: sent 2.0, 1 token at 2.05                    -> TTFT 50, E2E 50, no TPOT
std::vector<RequestRecord> KnownRecords() {
  std::vector<RequestRecord> records;
  records.push_back(Ok(0.0, {0.10, 0.12, 0.14, 0.16}, {1, 1, 1, 1}));
  records.push_back(Ok(1.0, {1.2, 1.3}, {2, 2}));
  RequestRecord failed;
  failed.start_s = 0.5;
  failed.end_s = 0.6;
  failed.status_code = 14;
  records.push_back(failed);
  records.push_back(Ok(2.0, {2.05}, {1}));
  return records;
}

TEST(ReplayStatsTest, KnownScheduleGivesHandComputedLatencies) {
  ReplayStats s = ComputeStats(KnownRecords(), Slo{});
  EXPECT_EQ(s.requests, 4);
  EXPECT_EQ(s.succeeded, 3);
  EXPECT_EQ(s.failed, 1);
  EXPECT_EQ(s.errors_by_code.at("UNAVAILABLE"), 1);
  EXPECT_NEAR(s.duration_s, 2.05, 1e-9);
  EXPECT_EQ(s.output_tokens, 9);
  EXPECT_EQ(s.input_tokens, 30);

  EXPECT_EQ(s.ttft_ms.count, 3);
  EXPECT_NEAR(s.ttft_ms.mean, 350.0 / 3, 1e-6);
  EXPECT_NEAR(s.ttft_ms.p50, 100, 1e-6);
  EXPECT_NEAR(s.ttft_ms.p90, 180, 1e-6);  // numpy: 100 + 0.8 * (200 - 100)
  EXPECT_NEAR(s.ttft_ms.p99, 198, 1e-6);
  EXPECT_NEAR(s.ttft_ms.min, 50, 1e-6);
  EXPECT_NEAR(s.ttft_ms.max, 200, 1e-6);

  EXPECT_EQ(s.tpot_ms.count, 2);  // r3 has one token: no TPOT
  EXPECT_NEAR(s.tpot_ms.mean, (20 + 100.0 / 3) / 2, 1e-6);

  EXPECT_EQ(s.itl_ms.count, 4);
  EXPECT_NEAR(s.itl_ms.mean, 40, 1e-6);
  EXPECT_NEAR(s.itl_ms.p50, 20, 1e-6);

  EXPECT_NEAR(s.e2e_ms.mean, (160 + 300 + 50) / 3.0, 1e-6);
  EXPECT_NEAR(s.request_throughput, 3 / 2.05, 1e-9);
  EXPECT_NEAR(s.output_token_throughput, 9 / 2.05, 1e-9);
  EXPECT_NEAR(s.total_token_throughput, 39 / 2.05, 1e-9);
}

TEST(ReplayStatsTest, GoodputCountsRequestsMeetingEveryObjective) {
  Slo ttft_only{150, 0, 0};
  ReplayStats a = ComputeStats(KnownRecords(), ttft_only);
  EXPECT_EQ(a.good_requests, 2);  // r0 (100) and r3 (50)
  EXPECT_NEAR(a.goodput, 2 / 2.05, 1e-9);
  EXPECT_NEAR(a.slo_attainment, 0.5, 1e-9);  // the failed request counts as a miss

  Slo ttft_and_tpot{150, 19, 0};  // r0's TPOT of 20 now misses; r3 has no TPOT and passes
  EXPECT_EQ(ComputeStats(KnownRecords(), ttft_and_tpot).good_requests, 1);

  Slo e2e{0, 0, 100};
  EXPECT_EQ(ComputeStats(KnownRecords(), e2e).good_requests, 1);
}

TEST(ReplayStatsTest, TimelineConservesTokensAndBusyTime) {
  ReplayStats s = ComputeStats(KnownRecords(), Slo{}, /*timeline_bucket_s=*/0.5);
  ASSERT_EQ(s.timeline.size(), 5u);  // ceil(2.05 / 0.5)
  double tokens = 0, busy = 0, completed = 0;
  for (const TimelinePoint& p : s.timeline) {
    tokens += p.output_tokens_per_s * 0.5;
    busy += p.inflight * 0.5;
    completed += p.completed_per_s * 0.5;
  }
  EXPECT_NEAR(tokens, 9, 1e-9);
  EXPECT_NEAR(busy, 0.16 + 0.3 + 0.1 + 0.05, 1e-9);
  EXPECT_NEAR(completed, 3, 1e-9);
  EXPECT_NEAR(s.timeline[0].inflight, 0.16 / 0.5, 1e-9);  // only r0 is open in [0, 0.5)
  EXPECT_NEAR(s.timeline[1].inflight, 0.1 / 0.5, 1e-9);   // r2, the failed one
}

TEST(ReplayStatsTest, PercentileInterpolatesLikeNumpy) {
  std::vector<double> v = {1, 2, 3, 4};
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 2.5);
  EXPECT_DOUBLE_EQ(Percentile(v, 90), 3.7);
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 4);
  EXPECT_DOUBLE_EQ(Percentile({7}, 99), 7);
}

TEST(ReplayStatsTest, DeliberateCancellationsAreNeitherFailuresNorMisses) {
  std::vector<RequestRecord> records = KnownRecords();
  RequestRecord cancelled;
  cancelled.start_s = 0.2;
  cancelled.end_s = 0.3;
  cancelled.status_code = 1;  // CANCELLED
  cancelled.cancelled_by_client = true;
  records.push_back(cancelled);
  ReplayStats s = ComputeStats(records, Slo{150, 0, 0});
  EXPECT_EQ(s.requests, 5);
  EXPECT_EQ(s.cancelled, 1);
  EXPECT_EQ(s.failed, 1);  // only the UNAVAILABLE one
  EXPECT_EQ(s.errors_by_code.count("CANCELLED"), 0u);
  EXPECT_NEAR(s.slo_attainment, 2.0 / 4, 1e-9);
}

TEST(ReplayStatsTest, EmptyRunHasZeroStats) {
  ReplayStats s = ComputeStats({}, Slo{});
  EXPECT_EQ(s.requests, 0);
  EXPECT_EQ(s.ttft_ms.count, 0);
}

}  // namespace
}  // namespace fluxion::cluster
