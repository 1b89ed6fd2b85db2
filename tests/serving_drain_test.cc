// Graceful shutdown on SIGTERM of live `fluxion decode` and `fluxion router` processes (issue 17,
// what Kubernetes does to a pod it deletes): readiness (the service name) goes NOT_SERVING while
// liveness (the whole server, "") stays SERVING, new requests are refused with UNAVAILABLE, and
// requests still live when --drain-timeout-ms passes end cleanly -- with their tokens and a clear
// error or finish reason naming the drain -- before the process exits by itself.
//
// No timing luck: the requests that must still be live when the drain's timeout passes are either
// in a prefill node slowed by --test-layer-delay-ms (6 layers x 3 s: at least 18 s, a lower bound
// no machine beats) or generating 30000 tokens on a decode node that sleeps 1 ms after every step
// (--test-step-delay-ms: at least 30 s), against drain timeouts of 8 s (decode) and 15 s (router),
// long enough that the checks made during the drain (health, a refused request) finish inside it
// on a loaded machine, and shorter than those lower bounds. Every wait is for a condition, with a
// generous deadline (common/wait_testing.h).
#include <signal.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cluster/backends.h"
#include "common/metrics_testing.h"
#include "gtest/gtest.h"
#include "tests/serving_cluster.h"
#include "tests/transfer_secret_testing.h"

namespace fluxion::testing {
namespace {

namespace v1 = ::fluxion::v1;

constexpr uint32_t kLongRequestTokens = 30000;

std::shared_ptr<grpc::Channel> ChannelTo(const ServerProcess& server) {
  return grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
}

// Whether `service` on `server` answers SERVING; waits for the answer (an unanswered check
// would read as not serving).
bool Serving(const ServerProcess& server, const std::string& service) {
  return cluster::HealthServing(ChannelTo(server), service, kGenerousWait);
}

// Polls until `service` on `server` answers anything but SERVING (true), or kGenerousWait passes.
bool WaitNotServing(const ServerProcess& server, const std::string& service) {
  return WaitFor([&] { return !Serving(server, service); });
}

// Two prefill nodes, one of them slow; each test starts the node it drains.
class GracefulShutdownTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::vector<std::string> ucx = UcxArgs("tcp");
    std::vector<std::string> fast = {"--model", TinyModelDir()};
    fast.insert(fast.end(), ucx.begin(), ucx.end());
    prefill_ = ServerProcess::Start("prefill", fast).release();
    std::vector<std::string> slow = fast;
    slow.insert(slow.end(), {"--test-layer-delay-ms", "3000"});
    slow_prefill_ = ServerProcess::Start("prefill", slow).release();
  }
  static void TearDownTestSuite() {
    delete prefill_;
    delete slow_prefill_;
    prefill_ = slow_prefill_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(prefill_, nullptr) << "prefill node did not start";
    ASSERT_NE(slow_prefill_, nullptr) << "slow prefill node did not start";
  }
  // A decode node trusting both prefill nodes, draining for at most `drain_timeout_ms`.
  static std::unique_ptr<ServerProcess> StartDecode(int drain_timeout_ms) {
    std::vector<std::string> args = {"--model",
                                     TinyModelDir(),
                                     "--kv-pages",
                                     "65536",
                                     "--nohuge-pages",
                                     "--prefill-address",
                                     prefill_->address() + "," + slow_prefill_->address(),
                                     "--drain-timeout-ms",
                                     absl::StrCat(drain_timeout_ms),
                                     "--test-step-delay-ms",
                                     "1"};
    std::vector<std::string> ucx = UcxArgs("tcp");
    args.insert(args.end(), ucx.begin(), ucx.end());
    return ServerProcess::Start("decode", args);
  }
  static ServerProcess* prefill_;
  static ServerProcess* slow_prefill_;
};
ServerProcess* GracefulShutdownTest::prefill_ = nullptr;
ServerProcess* GracefulShutdownTest::slow_prefill_ = nullptr;

TEST_F(GracefulShutdownTest, DecodeNodeEndsRequestsLiveAtTheDrainTimeoutWithUnavailable) {
  std::unique_ptr<ServerProcess> decode = StartDecode(8000);
  ASSERT_NE(decode, nullptr);
  DecodeClient client(decode->address());
  // A: decoding (30000 tokens, >= 30 s); B: in the slow prefill node (>= 18 s) when SIGTERM comes.
  GenerateResult a, b;
  std::thread ta([&] {
    a = client.Generate(GreedyRequest("drain-a", BytePrompt("hello"), kLongRequestTokens, "full",
                                      prefill_->address()));
  });
  ASSERT_TRUE(client.WaitForLoad([](const v1::DecodeLoad& l) { return l.running_requests() == 1; }));
  std::thread tb([&] {
    b = client.Generate(
        GreedyRequest("drain-b", BytePrompt("hello"), 8, "full", slow_prefill_->address()));
  });
  ASSERT_TRUE(
      client.WaitForLoad([](const v1::DecodeLoad& l) { return l.prefilling_requests() == 1; }));
  // The same answers over HTTP, for probes that cannot use gRPC health (TLS): ready, alive.
  EXPECT_TRUE(metrics::testing::HttpGet(decode->metrics_port(), "/readyz").ok());

  decode->Signal(SIGTERM);
  // Draining for 8 s with both requests live: not ready, still alive.
  EXPECT_TRUE(WaitNotServing(*decode, "fluxion.v1.DecodeService"));
  EXPECT_TRUE(Serving(*decode, "")) << "liveness flipped during the drain";
  EXPECT_FALSE(metrics::testing::HttpGet(decode->metrics_port(), "/readyz").ok());
  EXPECT_TRUE(metrics::testing::HttpGet(decode->metrics_port(), "/livez").ok());
  GenerateResult late = client.Generate(GreedyRequest("late", BytePrompt("hi"), 4, "full", ""));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(late.status.error_message().find("draining"), std::string::npos)
      << late.status.error_message();

  ta.join();
  tb.join();
  // A keeps the tokens it got and ends with an error naming the drain.
  EXPECT_EQ(a.status.error_code(), grpc::StatusCode::UNAVAILABLE) << a.status.error_message();
  EXPECT_NE(a.status.error_message().find("--drain-timeout-ms (8000 ms)"), std::string::npos)
      << a.status.error_message();
  EXPECT_GE(a.tokens.size(), 1u);
  EXPECT_LT(a.tokens.size(), kLongRequestTokens);
  ASSERT_TRUE(a.has_error) << "the stream should end with a GenerateError message";
  EXPECT_EQ(a.error.code(), static_cast<int32_t>(grpc::StatusCode::UNAVAILABLE));
  EXPECT_EQ(a.error.usage().completion_tokens(), a.tokens.size());
  // B never got a token: UNAVAILABLE, which says it may be retried elsewhere.
  EXPECT_EQ(b.status.error_code(), grpc::StatusCode::UNAVAILABLE) << b.status.error_message();
  EXPECT_NE(b.status.error_message().find("no token was sent, retry on another node"),
            std::string::npos)
      << b.status.error_message();
  EXPECT_TRUE(b.tokens.empty());
  // It exits by itself (the drain's 8 s, then at most --abort-wait-ms (2 s) for B's prefill to
  // answer, then the shutdown), long before the generous bound.
  EXPECT_TRUE(decode->Terminate(kGenerousWait)) << decode->Log();
  EXPECT_NE(decode->Log().find("2 requests were still live at the drain timeout"),
            std::string::npos)
      << decode->Log();
}

TEST_F(GracefulShutdownTest, RouterRefusesNewRequestsKeepsLivenessAndAbortsLeftovers) {
  std::unique_ptr<ServerProcess> decode = StartDecode(30000);
  ASSERT_NE(decode, nullptr);
  std::unique_ptr<ServerProcess> router =
      ServerProcess::Start("router", {"--decode", decode->address(), "--prefill",
                                      prefill_->address() + "," + slow_prefill_->address(),
                                      "--poll-ms", "50", "--drain-timeout-ms", "15000"});
  ASSERT_NE(router, nullptr);
  ASSERT_TRUE(WaitFor([&] { return Serving(*router, "fluxion.v1.DecodeService"); }))
      << router->Log();
  DecodeClient through_router(router->address());
  DecodeClient decode_client(decode->address());
  GenerateResult a;
  std::thread ta([&] {
    a = through_router.Generate(GreedyRequest("router-drain-a", BytePrompt("hello"),
                                              kLongRequestTokens, "full", prefill_->address()));
  });
  ASSERT_TRUE(
      decode_client.WaitForLoad([](const v1::DecodeLoad& l) { return l.running_requests() == 1; }));

  router->Signal(SIGTERM);
  EXPECT_TRUE(WaitNotServing(*router, "fluxion.v1.DecodeService"));
  EXPECT_FALSE(Serving(*router, "vllm.grpc.engine.VllmEngine"));
  EXPECT_TRUE(Serving(*router, "")) << "liveness flipped during the drain";
  GenerateResult late = through_router.Generate(GreedyRequest("late", BytePrompt("hi"), 4, "", ""));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(late.status.error_message().find("is draining"), std::string::npos)
      << late.status.error_message();

  ta.join();
  // Aborted at the drain timeout, downstream too: its tokens, then an abort naming the drain.
  EXPECT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(a.has_complete);
  EXPECT_EQ(a.complete.finish_reason(), v1::FINISH_REASON_ABORT);
  EXPECT_NE(a.complete.abort_reason().find("--drain-timeout-ms (15000 ms)"), std::string::npos)
      << a.complete.abort_reason();
  EXPECT_GE(a.tokens.size(), 1u);
  EXPECT_LT(a.tokens.size(), kLongRequestTokens);
  EXPECT_TRUE(router->Terminate(kGenerousWait)) << router->Log();
  // The decode node let the request go: its pages are back.
  const v1::DecodeLoad idle = decode_client.WaitAllPagesFree();
  EXPECT_EQ(idle.free_kv_pages(), idle.total_kv_pages());
}

// The bound is a flag of each command, checked before anything loads: a value out of [0, 1 h]
// stops the command with exit code 2 and a message naming the flag (one process per command:
// each start of the binary costs about a second here).
TEST(DrainTimeoutFlagTest, OutOfRangeValuesAreRefusedByEveryServer) {
  const std::string secret = " --transfer-secret-file " + TestTransferSecretFile();
  const std::vector<std::string> commands = {"router", "prefill --model /nonexistent" + secret,
                                             "decode --model /nonexistent" + secret};
  for (const std::string& command : commands) {
    const std::string out = ::testing::TempDir() + "/drain-flag.txt";
    const std::string line =
        absl::StrCat(FLUXION_BINARY, " ", command, " --drain-timeout-ms=-1 > ", out, " 2>&1");
    const int status = std::system(line.c_str());
    ASSERT_TRUE(WIFEXITED(status)) << line;
    EXPECT_EQ(WEXITSTATUS(status), 2) << line;
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("--drain-timeout-ms must be in [0, 3600000]"), std::string::npos)
        << line << ": " << text;
  }
}

}  // namespace
}  // namespace fluxion::testing
