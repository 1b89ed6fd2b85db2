// /metrics and health of live `fluxion prefill` and `fluxion decode` processes (issue 7): Prometheus'
// own linter passes on both endpoints (skipped without promtool), the endpoint-picker metrics
// (waiting, running, KV usage, page tokens) are there and move while requests run, the event
// metrics (requests by code, TTFT/E2E, transfer bytes, sparse head steps) count what was served,
// and each node reports its fluxion.v1 service name SERVING through grpc.health.v1, NOT_SERVING
// while draining.
//
// Every wait is for a condition (a scrape showing a value) with a generous deadline. Requests that
// must still be live while the test looks are given a lower bound on their duration that no
// machine beats: the decode node sleeps 10 ms after each step (--test-step-delay-ms), the slow
// prefill nodes 1 s after each of the 6 layers (--test-layer-delay-ms).
#include <signal.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <memory>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cluster/backends.h"
#include "common/metrics_testing.h"
#include "gtest/gtest.h"
#include "tests/serving_cluster.h"

namespace fluxion::testing {
namespace {

namespace v1 = ::fluxion::v1;

// The value of the sample whose name and labels are exactly `series` (as rendered, e.g.
// `fluxion_decode_requests_total{code="OK"}`); NaN when there is none.
double Sample(const std::string& text, const std::string& series) {
  return metrics::testing::SampleValue(text, series);
}

// A slow prefill node: 1 s after each of the 6 layers, so a request spends at least 6 s in it.
std::vector<std::string> SlowPrefillArgs() {
  std::vector<std::string> args = {"--model", TinyModelDir(), "--test-layer-delay-ms", "1000"};
  std::vector<std::string> ucx = UcxArgs("tcp");
  args.insert(args.end(), ucx.begin(), ucx.end());
  return args;
}

std::string Scrape(const ServerProcess& server) {
  auto body = metrics::testing::HttpGet(server.metrics_port(), "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  return body.ok() ? *body : std::string();
}

void ExpectPromtoolPasses(const std::string& exposition, const std::string& what) {
  if (!metrics::testing::HavePromtool()) {
    std::cout << "promtool not installed (Debian package prometheus): lint of " << what
              << " skipped\n";
    return;
  }
  absl::Status check = metrics::testing::PromtoolCheck(exposition);
  EXPECT_TRUE(check.ok()) << what << ": " << check << "\n" << exposition;
}

std::shared_ptr<grpc::Channel> ChannelTo(const ServerProcess& server) {
  return grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
}

// Polls `server`'s /metrics until `series` satisfies `want` (or `timeout`); returns the last value.
template <typename Want>
double WaitForSample(const ServerProcess& server, const std::string& series, Want want,
                     absl::Duration timeout = kGenerousWait) {
  return WaitForValue([&] { return Sample(Scrape(server), series); },
                      [&](double v) { return !std::isnan(v) && want(v); }, timeout,
                      absl::Milliseconds(2));
}

// Polls `server`'s /metrics until a scrape satisfies `want` (or kGenerousWait); returns that
// scrape (or the last one), so that several series are read from one moment.
template <typename Want>
std::string WaitForScrape(const ServerProcess& server, Want want) {
  return WaitForValue([&] { return Scrape(server); }, want, kGenerousWait,
                      absl::Milliseconds(2));
}

// One prefill node and one decode node whose arena holds 12 pages per layer and KV head (the tiny
// model has 6 layers x 4 KV heads, so 288 pages of 16 tokens): a request that grows to 12 pages
// per head fits alone, and a prompt of 10 pages per head (plus one page of headroom) must wait
// while another request holds more than one page per head. The decode nodes sleep 10 ms after
// each step, so a request of n tokens decodes for at least (n - 1) x 10 ms.
class ServingMetricsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::vector<std::string> ucx = UcxArgs("tcp");
    std::vector<std::string> pargs = {"--model", TinyModelDir()};
    pargs.insert(pargs.end(), ucx.begin(), ucx.end());
    prefill_ = ServerProcess::Start("prefill", pargs).release();
    if (prefill_ == nullptr) return;
    decode_ = StartDecode(prefill_->address()).release();
  }
  // A decode node trusting the prefill nodes `prefill_addresses` (comma list): a request may name
  // only those (docs/SECURITY.md), so tests with a prefill node of their own start their own.
  static std::unique_ptr<ServerProcess> StartDecode(const std::string& prefill_addresses) {
    std::vector<std::string> dargs = {"--model", TinyModelDir(), "--kv-pages", "288",
                                      "--headroom-tokens", "16", "--prefill-address",
                                      prefill_addresses, "--admission-timeout-ms", "30000",
                                      "--quarantine-ms", "1000",
                                      "--default-policy", "fluxion", "--nohuge-pages",
                                      "--test-step-delay-ms", "10"};
    std::vector<std::string> ucx = UcxArgs("tcp");
    dargs.insert(dargs.end(), ucx.begin(), ucx.end());
    return ServerProcess::Start("decode", dargs);
  }
  static void TearDownTestSuite() {
    delete decode_;  // kills the process
    delete prefill_;
    decode_ = prefill_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(prefill_, nullptr) << "prefill node did not start";
    ASSERT_NE(decode_, nullptr) << "decode node did not start";
  }
  static ServerProcess* prefill_;
  static ServerProcess* decode_;
};
ServerProcess* ServingMetricsTest::prefill_ = nullptr;
ServerProcess* ServingMetricsTest::decode_ = nullptr;

TEST_F(ServingMetricsTest, NamedServicesReportServingThroughGrpcHealth) {
  EXPECT_TRUE(cluster::HealthServing(ChannelTo(*decode_), "fluxion.v1.DecodeService",
                                     kGenerousWait));
  EXPECT_TRUE(cluster::HealthServing(ChannelTo(*prefill_), "fluxion.v1.PrefillService",
                                     kGenerousWait));
  EXPECT_TRUE(cluster::HealthServing(ChannelTo(*decode_), "", kGenerousWait));
  // Each node registers only its own service (the other name is NOT_FOUND).
  EXPECT_FALSE(cluster::HealthServing(ChannelTo(*decode_), "fluxion.v1.PrefillService",
                                      kGenerousWait));
  EXPECT_FALSE(cluster::HealthServing(ChannelTo(*prefill_), "fluxion.v1.DecodeService",
                                      kGenerousWait));
}

// Started with --cpu-threads 1 (ServerProcess): each node says so, and runs with
// OMP_NUM_THREADS=1 in its environment, so the threads it computes on (started after the setup:
// the decode scheduler, the prefill batch and handler threads) get one thread too
// (kernels/cpu/process_cpu.h).
TEST_F(ServingMetricsTest, BothNodesRunOnAPoolOfTheirCpuThreads) {
  for (const ServerProcess* node : {prefill_, decode_}) {
    EXPECT_NE(node->Log().find(", 1 CPU thread(s)"), std::string::npos) << node->Log();
    std::ifstream environ("/proc/" + std::to_string(node->pid()) + "/environ");
    std::string entry;
    bool one = false;
    while (std::getline(environ, entry, '\0')) one = one || entry == "OMP_NUM_THREADS=1";
    EXPECT_TRUE(one) << "pid " << node->pid();
  }
}

TEST_F(ServingMetricsTest, EndpointsPassPromtoolAndLoadMetricsFollowRequests) {
  const std::string idle = Scrape(*decode_);
  ExpectPromtoolPasses(idle, "decode /metrics (idle)");
  ExpectPromtoolPasses(Scrape(*prefill_), "prefill /metrics (idle)");
  // The endpoint picker's inputs, idle.
  EXPECT_EQ(Sample(idle, "fluxion_decode_requests_running"), 0);
  EXPECT_EQ(Sample(idle, "fluxion_decode_requests_waiting"), 0);
  EXPECT_EQ(Sample(idle, "fluxion_decode_requests_awaiting_pages"), 0);
  EXPECT_EQ(Sample(idle, "fluxion_decode_requests_prefilling"), 0);
  EXPECT_EQ(Sample(idle, "fluxion_kv_cache_usage_ratio"), 0);
  EXPECT_EQ(Sample(idle, "fluxion_kv_page_tokens"), 16);
  EXPECT_EQ(Sample(idle, "fluxion_kv_pages_capacity"), 288);
  EXPECT_EQ(Sample(idle, "fluxion_kv_pages_free"), 288);
  EXPECT_EQ(Sample(idle, "fluxion_kv_pages_quarantined"), 0);
  EXPECT_EQ(Sample(idle, "fluxion_kv_cache_config_info{block_size=\"16\",num_gpu_blocks=\"12\","
                         "num_pages=\"288\",page_tokens=\"16\"}"),
            1);
  EXPECT_EQ(Sample(idle, "fluxion_decode_step_gpu_seconds_total"), 0);
  EXPECT_EQ(Sample(idle, "fluxion_sparse_budget_ratio{policy=\"fluxion\"}"), 0.1);
  const double ok_before = std::isnan(Sample(idle, "fluxion_decode_requests_total{code=\"OK\"}"))
                               ? 0
                               : Sample(idle, "fluxion_decode_requests_total{code=\"OK\"}");
  const double e2e_before = Sample(idle, "fluxion_decode_e2e_request_latency_seconds_count");
  const double itl_before = Sample(idle, "fluxion_decode_inter_token_latency_seconds_count");

  // A: 5 prompt tokens, 180 more (12 pages per head at the end). B: 150 prompt tokens, which need
  // 10 + 1 pages per head free: B waits while A holds 2+ pages per head, then runs.
  DecodeClient client(decode_->address());
  GenerateResult a, b;
  std::thread ta([&] {
    a = client.Generate(GreedyRequest("metrics-a", BytePrompt("hello"), 180, "full", ""));
  });
  EXPECT_EQ(WaitForSample(*decode_, "fluxion_decode_requests_running", [](double v) { return v == 1; }),
            1);
  const double held = 288 - WaitForSample(*decode_, "fluxion_kv_pages_free",
                                          [](double v) { return v < 288 - 24; });
  EXPECT_GT(held, 24) << "A should hold two pages per layer and head by now";
  const std::string running = Scrape(*decode_);
  EXPECT_GT(Sample(running, "fluxion_kv_cache_usage_ratio"), 0);
  ExpectPromtoolPasses(running, "decode /metrics (running)");
  std::thread tb([&] {
    b = client.Generate(
        GreedyRequest("metrics-b", BytePrompt(std::string(150, 'x')), 4, "full", ""));
  });
  // B waits (for pages); A, decoding, does not (A has at least 1.6 s of its 180 tokens left).
  // Both gauges are read from the one scrape that shows B waiting: a second scrape could come
  // after A finished and B was admitted.
  const std::string waiting_scrape = WaitForScrape(*decode_, [](const std::string& text) {
    return Sample(text, "fluxion_decode_requests_awaiting_pages") == 1;
  });
  EXPECT_EQ(Sample(waiting_scrape, "fluxion_decode_requests_awaiting_pages"), 1)
      << "B should wait for pages while A runs";
  EXPECT_GE(Sample(waiting_scrape, "fluxion_decode_requests_waiting"), 1);
  ta.join();
  tb.join();
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(a.tokens.size(), 180u);
  EXPECT_EQ(b.tokens.size(), 4u);

  // Finished: load back to idle, the event metrics counted both requests. The streams end before
  // the node's bookkeeping does (pages, then the running count, then the request counters), so
  // each is waited for rather than read once.
  EXPECT_EQ(WaitForSample(*decode_, "fluxion_kv_pages_free", [](double v) { return v == 288; }),
            288);
  EXPECT_EQ(WaitForSample(*decode_, "fluxion_decode_requests_running", [](double v) { return v == 0; }),
            0);
  const double e2e_want = (std::isnan(e2e_before) ? 0 : e2e_before) + 2;
  EXPECT_EQ(WaitForSample(*decode_, "fluxion_decode_e2e_request_latency_seconds_count",
                          [&](double v) { return v == e2e_want; }),
            e2e_want);
  const std::string after = Scrape(*decode_);
  ExpectPromtoolPasses(after, "decode /metrics (after)");
  EXPECT_EQ(Sample(after, "fluxion_decode_requests_running"), 0);
  EXPECT_EQ(Sample(after, "fluxion_decode_requests_waiting"), 0);
  EXPECT_EQ(Sample(after, "fluxion_decode_requests_total{code=\"OK\"}"), ok_before + 2);
  EXPECT_EQ(Sample(after, "fluxion_decode_e2e_request_latency_seconds_count"),
            (std::isnan(e2e_before) ? 0 : e2e_before) + 2);
  EXPECT_GE(Sample(after, "fluxion_decode_time_to_first_token_seconds_count"), 2);
  EXPECT_GE(Sample(after, "fluxion_decode_time_per_output_token_seconds_count"), 2);
  EXPECT_GE(Sample(after, "fluxion_decode_queue_time_seconds_count"), 2);
  EXPECT_GE(Sample(after, "fluxion_decode_finished_total{reason=\"length\"}"), 2);
  EXPECT_GE(Sample(after, "fluxion_decode_prompt_tokens_total"), 155);
  EXPECT_GE(Sample(after, "fluxion_decode_generation_tokens_total"), 184);
  EXPECT_GE(Sample(after, "fluxion_decode_step_seconds_count"), 179);
  EXPECT_GT(Sample(after, "fluxion_decode_step_cpu_seconds_total"), 0);
  EXPECT_GT(Sample(after, "fluxion_transfer_bytes_total{direction=\"received\"}"), 0);
  EXPECT_GE(Sample(after, "fluxion_transfer_seconds_count"), 2);
  // Every write of an honest prefill node landed inside the request's runs.
  EXPECT_EQ(Sample(after, "fluxion_transfer_landing_refused_total"), 0);
  EXPECT_GE(Sample(after, "fluxion_sparse_read_fraction_count{policy=\"full\"}"), 2);
  EXPECT_GE(Sample(after, "fluxion_decode_preemptions_total"), 0);
  // vLLM's per-request series, under our names (docs/METRICS.md, "vLLM's names").
  EXPECT_EQ(Sample(after, "fluxion_model_info{model_name=\"fluxion-tiny-retrieval\"}"), 1);
  EXPECT_GE(Sample(after, "fluxion_decode_request_prompt_tokens_count"), 2);
  EXPECT_GE(Sample(after, "fluxion_decode_request_prompt_tokens_sum"), 155);
  EXPECT_GE(Sample(after, "fluxion_decode_request_generation_tokens_sum"), 184);
  EXPECT_GE(Sample(after, "fluxion_decode_request_prefill_time_seconds_count"), 2);
  EXPECT_GE(Sample(after, "fluxion_decode_request_decode_time_seconds_count"), 2);
  // One observation per token after each request's first chunk: at most 179 + 3 here (how many
  // tokens a chunk carries depends on the machine, so no lower bound).
  const double itl = Sample(after, "fluxion_decode_inter_token_latency_seconds_count");
  EXPECT_FALSE(std::isnan(itl));
  EXPECT_LE(itl - itl_before, 182);

  const std::string prefill = Scrape(*prefill_);
  ExpectPromtoolPasses(prefill, "prefill /metrics (after)");
  EXPECT_EQ(Sample(prefill, "fluxion_prefill_requests_queued"), 0);
  EXPECT_EQ(Sample(prefill, "fluxion_prefill_prompt_tokens_queued"), 0);
  EXPECT_EQ(Sample(prefill, "fluxion_prefill_requests_running"), 0);
  EXPECT_GE(Sample(prefill, "fluxion_prefill_requests_total{code=\"OK\"}"), 2);
  EXPECT_GE(Sample(prefill, "fluxion_prefill_prompt_tokens_total"), 155);
  EXPECT_GE(Sample(prefill, "fluxion_prefill_compute_seconds_count"), 2);
  EXPECT_GE(Sample(prefill, "fluxion_prefill_transfer_tail_seconds_count"), 2);
  EXPECT_GT(Sample(prefill, "fluxion_transfer_bytes_total{direction=\"sent\"}"), 0);
  EXPECT_EQ(Sample(prefill, "fluxion_transfer_failures_total{cause=\"peer_unreachable\"}"), 0);
}

TEST_F(ServingMetricsTest, SparseHeadStepsAndReadFractionAreCountedPerPolicy) {
  DecodeClient client(decode_->address());
  // The default policy (fluxion) over a prompt longer than sinks + local window.
  GenerateResult r =
      client.Generate(GreedyRequest("metrics-sparse", BytePrompt(std::string(120, 'y')), 8, "", ""));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_TRUE(r.has_complete);
  const std::string text = Scrape(*decode_);
  const double selected = Sample(text, "fluxion_sparse_head_steps_total{kind=\"selected\"}");
  const double bypassed = Sample(text, "fluxion_sparse_head_steps_total{kind=\"bypassed\"}");
  ASSERT_FALSE(std::isnan(selected));
  ASSERT_FALSE(std::isnan(bypassed));
  // 7 decode steps (the first token came from the prefill node) x 6 layers x 4 KV heads.
  EXPECT_GE(selected + bypassed, 7 * 24);
  EXPECT_GE(Sample(text, "fluxion_sparse_read_fraction_count{policy=\"fluxion\"}"), 1);
  EXPECT_GT(Sample(text, "fluxion_sparse_rows_total{kind=\"context\"}"),
            Sample(text, "fluxion_sparse_rows_total{kind=\"attended\"}") - 1e-9);
  ExpectPromtoolPasses(text, "decode /metrics (sparse)");
}

TEST_F(ServingMetricsTest, PrefillNodeKilledMidTransferCountsAFailureAndQuarantinedPages) {
  std::unique_ptr<ServerProcess> slow = ServerProcess::Start("prefill", SlowPrefillArgs());
  ASSERT_NE(slow, nullptr);
  std::unique_ptr<ServerProcess> decode = StartDecode(prefill_->address() + "," + slow->address());
  ASSERT_NE(decode, nullptr);
  const std::string failures = "fluxion_transfer_failures_total{cause=\"peer_unreachable\"}";
  const double before = Sample(Scrape(*decode), failures);
  ASSERT_FALSE(std::isnan(before));
  DecodeClient client(decode->address());
  GenerateResult r;
  std::thread t([&] {
    r = client.Generate(
        GreedyRequest("metrics-killed", BytePrompt("hello"), 8, "full", slow->address()));
  });
  EXPECT_EQ(WaitForSample(*decode, "fluxion_decode_requests_prefilling",
                          [](double v) { return v == 1; }),
            1);
  // Killed once a layer's KV has landed (the node's sent-bytes counter moved): mid-transfer.
  EXPECT_GT(WaitForSample(*slow, "fluxion_transfer_bytes_total{direction=\"sent\"}",
                          [](double v) { return v > 0; }),
            0);
  slow->Kill();
  t.join();
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  // Counted as the call ends, which may be a moment after the client saw its status.
  EXPECT_EQ(WaitForSample(*decode, failures, [&](double v) { return v == before + 1; }),
            before + 1);
  EXPECT_GE(WaitForSample(*decode, "fluxion_decode_requests_total{code=\"UNAVAILABLE\"}",
                          [](double v) { return v >= 1; }),
            1);
  EXPECT_GE(WaitForSample(*decode, "fluxion_decode_finished_total{reason=\"error\"}",
                          [](double v) { return v >= 1; }),
            1);
  // The reservation was quarantined (the dead peer's puts may still have been in flight) -- the
  // counter says so whenever it is read -- and is freed after --quarantine-ms (1 s).
  EXPECT_GE(WaitForSample(*decode, "fluxion_kv_quarantined_reservations_total{reason=\"no_reply\"}",
                          [](double v) { return v >= 1; }),
            1);
  EXPECT_EQ(WaitForSample(*decode, "fluxion_kv_pages_quarantined", [](double v) { return v == 0; }),
            0);
}

// A request whose KV is still being prefilled waits as far as a scheduler is concerned (vLLM's
// num_requests_waiting counts requests waiting for remote KV; llm-d's endpoint picker reads
// fluxion_decode_requests_waiting as that, k8s/llm-d/epp-config.yaml). The prefill node is slowed
// (6 layers x 1 s), so the request is in prefill for at least 6 s.
TEST_F(ServingMetricsTest, RequestsBeingPrefilledCountAsWaiting) {
  std::unique_ptr<ServerProcess> slow = ServerProcess::Start("prefill", SlowPrefillArgs());
  ASSERT_NE(slow, nullptr);
  std::unique_ptr<ServerProcess> decode = StartDecode(slow->address());
  ASSERT_NE(decode, nullptr);
  DecodeClient client(decode->address());
  GenerateResult result;
  std::thread t([&] {
    result = client.Generate(GreedyRequest("waiting", BytePrompt("hello"), 4, "full", ""));
  });
  // One scrape that shows the request prefilling also shows it waiting, and not for pages.
  const std::string text = WaitForScrape(*decode, [](const std::string& t) {
    return Sample(t, "fluxion_decode_requests_prefilling") == 1;
  });
  EXPECT_EQ(Sample(text, "fluxion_decode_requests_prefilling"), 1);
  EXPECT_EQ(Sample(text, "fluxion_decode_requests_waiting"), 1);
  EXPECT_EQ(Sample(text, "fluxion_decode_requests_awaiting_pages"), 0);
  EXPECT_EQ(Sample(text, "fluxion_decode_requests_running"), 0);
  t.join();
  EXPECT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(
      WaitForSample(*decode, "fluxion_decode_requests_waiting", [](double v) { return v == 0; }),
      0);
}

// Drains a decode node of its own. The request goes through a slow prefill node (6 layers x 1 s),
// so it is live for at least 6 s after it reached the node, while the health is read.
TEST_F(ServingMetricsTest, DrainingDecodeNodeReportsNotServing) {
  std::unique_ptr<ServerProcess> slow = ServerProcess::Start("prefill", SlowPrefillArgs());
  ASSERT_NE(slow, nullptr);
  std::unique_ptr<ServerProcess> decode = StartDecode(prefill_->address() + "," + slow->address());
  ASSERT_NE(decode, nullptr);
  DecodeClient client(decode->address());
  GenerateResult running;
  std::atomic<bool> done{false};
  std::thread t([&] {
    running = client.Generate(
        GreedyRequest("metrics-drain", BytePrompt("hello"), 8, "full", slow->address()));
    done = true;
  });
  EXPECT_EQ(WaitForSample(*decode, "fluxion_decode_requests_prefilling",
                          [](double v) { return v == 1; }),
            1);
  decode->Signal(SIGTERM);
  // Each check waits for its answer (an unanswered check would read as not serving).
  const bool serving = !WaitFor([&] {
    return !cluster::HealthServing(ChannelTo(*decode), "fluxion.v1.DecodeService",
                                   kGenerousWait);
  });
  const bool request_was_live = !done.load();  // so the process was still up, draining
  EXPECT_FALSE(serving) << "the named service stayed SERVING while draining";
  EXPECT_TRUE(request_was_live) << "the request ended before NOT_SERVING was seen";
  // Liveness asks the whole server: a draining node is alive and must not be restarted.
  EXPECT_TRUE(cluster::HealthServing(ChannelTo(*decode), "", kGenerousWait));
  EXPECT_FALSE(done.load()) << "the request ended before liveness was read";
  EXPECT_TRUE(cluster::HealthServing(ChannelTo(*slow), "fluxion.v1.PrefillService",
                                     kGenerousWait));
  t.join();
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.tokens.size(), 8u);
  EXPECT_TRUE(decode->Terminate(kGenerousWait));
}

}  // namespace
}  // namespace fluxion::testing
