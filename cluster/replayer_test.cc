#include "cluster/replayer.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "cluster/fake_decode_service.h"
#include "cluster/replay_report.h"
#include "common/test_temp_dir.h"
#include "common/wait_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

using testing::FakeDecodeService;
using testing::FakeServer;
using ::testing::HasSubstr;

Schedule Timed(int n, double gap_s, int64_t input, int64_t output) {
  Schedule s;
  for (int i = 0; i < n; ++i) s.requests.push_back({i * gap_s, input, output, {}, i});
  return s;
}

ReplayOptions Options(const FakeServer& server) {
  ReplayOptions o;
  o.target = server.address();
  o.progress = false;
  o.timeout_s = 20;
  return o;
}

// The fake streams its first token after 40 ms, then one token every 10 ms, and rejects every
// fifth request with UNAVAILABLE. So TTFT ~40 ms, TPOT = ITL ~10 ms, E2E ~40 + 10 * (n - 1) ms.
// Those are lower bounds (the fake sleeps them); how much later a busy machine delivers the tokens
// is not the replayer's business, so only the lower bounds are checked here, and the statistics'
// arithmetic exactly in replay_stats_test.cc.
TEST(ReplayerTest, StatisticsMatchTheFakeServersKnownTimetable) {
  FakeDecodeService service;
  FakeDecodeService::Behaviour b;
  b.reject = [](const v1::GenerateRequest& r) {
    int index = std::stoi(r.request_id().substr(r.request_id().rfind('-') + 1));
    return index % 5 == 0 ? grpc::Status(grpc::UNAVAILABLE, "fake: rejected") : grpc::Status::OK;
  };
  service.SetBehaviour(b);
  FakeServer server(&service, "fluxion.v1.DecodeService");

  Schedule schedule = Timed(10, 0.05, 33, 6);
  auto records = Replayer(Options(server)).Run(schedule);
  ASSERT_TRUE(records.ok()) << records.status();
  ASSERT_EQ(records->size(), 10u);
  ReplayStats s = ComputeStats(*records, Slo{});
  EXPECT_EQ(s.failed, 2);
  EXPECT_EQ(s.errors_by_code.at("UNAVAILABLE"), 2);
  EXPECT_EQ(s.output_tokens, 8 * 6);
  EXPECT_EQ(s.input_tokens, 8 * 33);
  // The fake is never faster than its timetable: the k-th token cannot arrive before 40 + 10 k ms
  // after the request was sent (a token that arrives late can be followed at once by the next, so
  // single gaps have no lower bound; their sums do).
  EXPECT_GE(s.ttft_ms.min, 39);
  EXPECT_GE(s.e2e_ms.min, 89);  // 40 + 5 x 10
  EXPECT_EQ(s.ttft_ms.count, 8);
  EXPECT_EQ(s.tpot_ms.count, 8);
  EXPECT_EQ(s.itl_ms.count, 8 * 5);
  EXPECT_GT(s.tpot_ms.min, 0);
  for (const RequestRecord& r : *records) {
    EXPECT_GE(r.start_s, r.scheduled_s);  // never sent before its time
    for (size_t k = 0; k < r.chunk_times_s.size(); ++k) {
      EXPECT_GE(r.chunk_times_s[k] - r.start_s, 0.0395 + 0.01 * k - 1e-4)
          << "request " << r.index << " token " << k;
    }
    if (r.ok()) {
      EXPECT_GE(r.end_s, r.chunk_times_s.back());
    }
  }
  // What went on the wire: prompt length, max_tokens, EOS ignored, time budget.
  auto seen = service.seen();
  ASSERT_EQ(seen.size(), 10u);
  for (const auto& r : seen) {
    EXPECT_EQ(r.request.prompt_token_ids_size(), 33);
    EXPECT_EQ(r.request.sampling().max_tokens(), 6u);
    EXPECT_TRUE(r.request.sampling().ignore_eos());
    EXPECT_EQ(r.request.timeout_ms(), 20000u);
  }
}

TEST(ReplayerTest, FixedConcurrencyKeepsExactlyThatManyInFlight) {
  FakeDecodeService service;
  FakeServer server(&service, "fluxion.v1.DecodeService");
  ReplayOptions o = Options(server);
  o.concurrency = 3;
  auto records = Replayer(o).Run(Timed(9, 0, 8, 3));
  ASSERT_TRUE(records.ok()) << records.status();
  EXPECT_EQ(ComputeStats(*records, Slo{}).succeeded, 9);
  EXPECT_EQ(service.max_concurrent(), 3);
}

// The answer check's input: each record keeps the ids it received only when asked to.
TEST(ReplayerTest, OutputIdsAreKeptOnlyWhenAsked) {
  FakeDecodeService service;
  FakeServer server(&service, "fluxion.v1.DecodeService");
  ReplayOptions o = Options(server);
  o.concurrency = 2;
  auto plain = Replayer(o).Run(Timed(2, 0, 8, 3));
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (const RequestRecord& r : *plain) EXPECT_TRUE(r.output_ids.empty());
  o.keep_output_ids = true;
  auto kept = Replayer(o).Run(Timed(2, 0, 8, 3));
  ASSERT_TRUE(kept.ok()) << kept.status();
  for (const RequestRecord& r : *kept) {
    EXPECT_THAT(r.output_ids, ::testing::ElementsAre(100, 101, 102));  // the fake's tokens
  }
}

TEST(ReplayerTest, InterruptCancelsRequestsInFlightAndReturnsWhatItHas) {
  FakeDecodeService service;
  FakeServer server(&service, "fluxion.v1.DecodeService");
  Replayer replayer(Options(server));
  // Interrupted once all four are in flight at the server. Left alone each would end OK after
  // 5 s (500 tokens), so CANCELLED shows that the interrupt ended them.
  std::thread interrupter([&] {
    EXPECT_TRUE(WaitFor([&] { return service.seen().size() == 4; }));
    replayer.Interrupt();
  });
  auto records = replayer.Run(Timed(4, 0, 8, 500));
  interrupter.join();
  ASSERT_TRUE(records.ok()) << records.status();
  ASSERT_EQ(records->size(), 4u);
  for (const RequestRecord& r : *records) EXPECT_EQ(r.status_code, grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitFor([&] {
    for (const auto& seen : service.seen()) {
      if (!seen.cancelled) return false;
    }
    return true;
  })) << "the server's calls were not cancelled";
}

TEST(ReplayerTest, ChosenRequestsAreCancelledOnPurposeAndReportedApart) {
  FakeDecodeService service;
  FakeServer server(&service, "fluxion.v1.DecodeService");
  ReplayOptions o = Options(server);
  o.cancel_fraction = 0.5;
  // The fake needs at least 40 + 199 x 10 ms, about 2 s, for 200 tokens: a request picked for
  // cancelling cannot end by itself before its cancel lands unless the machine stalls the
  // replayer for that long (then it counts as finished, and the seed check below would differ).
  o.cancel_after_s = 0.1;
  o.cancel_seed = 7;
  auto records = Replayer(o).Run(Timed(12, 0.01, 8, 200));
  ASSERT_TRUE(records.ok()) << records.status();
  ReplayStats s = ComputeStats(*records, Slo{1000, 0, 0});
  EXPECT_GT(s.cancelled, 0);
  EXPECT_LT(s.cancelled, 12);
  EXPECT_EQ(s.failed, 0);
  EXPECT_EQ(s.cancelled + s.succeeded, 12);
  EXPECT_NEAR(s.slo_attainment, 1.0, 1e-9);  // cancelled requests are not misses
  int cancelled_on_server = 0;
  for (const auto& seen : service.seen()) cancelled_on_server += seen.cancelled;
  EXPECT_EQ(cancelled_on_server, s.cancelled);
  for (const RequestRecord& r : *records) {
    if (r.cancelled_by_client) {
      EXPECT_EQ(r.status_code, grpc::StatusCode::CANCELLED);
      EXPECT_GE(r.end_s - r.start_s, 0.1 - 1e-3);  // not before its time
      EXPECT_LT(r.output_tokens, 200);
    }
  }
  // The same seed picks the same requests.
  auto again = Replayer(o).Run(Timed(12, 0.01, 8, 200));
  ASSERT_TRUE(again.ok());
  for (size_t i = 0; i < records->size(); ++i) {
    EXPECT_EQ((*records)[i].cancelled_by_client, (*again)[i].cancelled_by_client) << i;
  }
}

// Found by an attacker: --vocab-size 1 divided by zero building the first prompt.
TEST(ReplayerTest, OptionsOutsideTheirRangeAreInvalidArgumentNamingTheFlag) {
  const std::vector<std::pair<std::string, std::function<void(ReplayOptions&)>>> cases = {
      {"--vocab-size", [](ReplayOptions& o) { o.vocab_size = 1; }},
      {"--vocab-size", [](ReplayOptions& o) { o.vocab_size = 0; }},
      {"--concurrency", [](ReplayOptions& o) { o.concurrency = -1; }},
      {"--max-inflight", [](ReplayOptions& o) { o.max_inflight = int64_t{1} << 40; }},
      {"--timeout-s", [](ReplayOptions& o) { o.timeout_s = 0; }},
      {"--timeout-s", [](ReplayOptions& o) { o.timeout_s = 1e10; }},
      {"--temperature", [](ReplayOptions& o) { o.temperature = std::nanf(""); }},
      {"--budget", [](ReplayOptions& o) { o.sparse_budget = -1.0f; }},
      {"--cancel-fraction", [](ReplayOptions& o) { o.cancel_fraction = 1.5; }},
      {"--cancel-after-s", [](ReplayOptions& o) { o.cancel_after_s = -1; }},
  };
  for (const auto& [flag, set] : cases) {
    ReplayOptions o;
    o.target = "127.0.0.1:1";
    o.progress = false;
    set(o);
    EXPECT_THAT(std::string(ValidateReplayOptions(o).message()), HasSubstr(flag));
    // Run() checks before it connects: no 10 s connect timeout, no division by zero.
    EXPECT_EQ(Replayer(o).Run(Timed(1, 0, 1, 1)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << flag;
  }
  EXPECT_TRUE(ValidateReplayOptions(ReplayOptions{}).ok());
}

TEST(ReplayerTest, UnreachableTargetIsUnavailable) {
  ReplayOptions o;
  o.target = "127.0.0.1:1";
  o.progress = false;
  o.connect_timeout_s = 0.3;
  EXPECT_EQ(Replayer(o).Run(Timed(1, 0, 1, 1)).status().code(), absl::StatusCode::kUnavailable);
}

TEST(ReplayerTest, ReportWritesJsonCsvAndPlots) {
  FakeDecodeService service;
  FakeServer server(&service, "fluxion.v1.DecodeService");
  auto records = Replayer(Options(server)).Run(Timed(5, 0.01, 8, 4));
  ASSERT_TRUE(records.ok()) << records.status();
  ReplayStats stats = ComputeStats(*records, Slo{1000, 0, 0});
  RunDescription run;
  run.config["target"] = server.address();
  std::string summary = FormatSummary(stats, run);
  EXPECT_NE(summary.find("TTFT"), std::string::npos);
  EXPECT_NE(summary.find("goodput"), std::string::npos);
  nlohmann::json json = StatsToJson(stats, run);
  EXPECT_EQ(json["succeeded"], 5);
  EXPECT_TRUE(json["ttft_ms"].contains("p99"));
  ScopedTestTempDir temp;
  std::string dir = temp.File("replay_report_test");
  EXPECT_TRUE(WriteRequestsCsv(dir + "_requests.csv", *records).ok());
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "gnuplot not installed (Debian package gnuplot-nox)";
  }
  for (const char* format : {"png", "svg"}) {
    auto plots = RenderPlots(dir, format, *records, stats, "test");
    ASSERT_TRUE(plots.ok()) << plots.status();
    for (const std::string& path : *plots) {
      std::ifstream in(path, std::ios::binary | std::ios::ate);
      EXPECT_GT(static_cast<int64_t>(in.tellg()), 1000) << path;
    }
  }
}

}  // namespace
}  // namespace fluxion::cluster
