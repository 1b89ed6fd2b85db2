// The HTTP API against careless and hostile clients, in one process (openai_http_testing.h):
// clients that hang up while their connection waits (a whole answer, a prefill before the first
// token, a prompt being tokenized) cancel at once; idle connections from one address cannot lock
// the API out, and idle connections close while waiting ones do not; tokenization runs off the
// polling thread on a bounded pool and is bounded per request; permanent refusals are 400, not
// 429. Every wait is on a condition with a generous deadline (kPatience), never a fixed sleep.
#include <poll.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "cluster/http_testing.h"
#include "cluster/openai_client.h"
#include "cluster/openai_http.h"
#include "cluster/openai_http_testing.h"
#include "common/metrics_names.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/hf_tokenizer.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster::openai {
namespace {

using ::testing::HasSubstr;
using testing::kPatience;
using ::testing::Not;
using ::testing::StartsWith;

class OpenAiHttpGuardTest : public testing::OpenAiHttpFixture {
 protected:
  // A raw POST of `json` to `path` on a new connection; the socket, or -1.
  int SendPost(const std::string& path, const std::string& json, const char* source = nullptr) {
    const int fd = testing::ConnectLoopback(http_->port(), source);
    if (fd < 0) return -1;
    const std::string request =
        absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n",
                     "Content-Length: ", json.size(), "\r\n\r\n", json);
    if (!testing::SendAll(fd, request)) {
      close(fd);
      return -1;
    }
    return fd;
  }
  // GET /health on a new connection from 127.0.0.1: the raw answer (empty if none in time).
  std::string Health() {
    const int fd = testing::ConnectLoopback(http_->port());
    if (fd < 0) return "";
    testing::SendAll(fd, "GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    std::string answer = testing::ReadUntilClose(fd, kPatience);
    close(fd);
    return answer;
  }
  double Counter(const char* name, const std::string& reason) {
    return registry_.AddCounter(name, "", {{"reason", reason}})->value();
  }
  // Whether the counter reaches `n` within kPatience.
  bool AwaitCounter(const char* name, const std::string& reason, double n) {
    const absl::Time give_up = absl::Now() + kPatience;
    while (Counter(name, reason) < n && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return Counter(name, reason) >= n;
  }
};

// Whether the server closes `fd` within kPatience (as opposed to keeping it open that long).
bool AwaitClosedByServer(int fd) {
  const absl::Time give_up = absl::Now() + kPatience;
  char buf[256];
  while (absl::Now() < give_up) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return true;
  }
  return false;
}

// A whole (non-streamed) answer waits suspended until the generation ends; a client that hangs
// up meanwhile cancels the Generate call at once (before: it ran to the end, 6,000 tokens).
TEST_F(OpenAiHttpGuardTest, HangUpDuringAWholeAnswerCancelsItsCall) {
  StreamBytes("a");
  fake_.wait_for_cancel = true;  // one token, then nothing until cancelled
  const int fd = SendPost("/v1/completions", R"({"model":"m","prompt":"x","max_tokens":64})");
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(fake_.AwaitStarted(1));
  close(fd);
  EXPECT_TRUE(fake_.AwaitCancelled(1)) << "the call outlived its client";
}

// Before the first token (a prefill running) a stream's status line is not sent yet and its
// connection waits suspended: a hang-up then cancels too (before: the prefill ran on).
TEST_F(OpenAiHttpGuardTest, HangUpBeforeTheFirstTokenCancelsItsCall) {
  StreamBytes("abc");
  fake_.hold_first = true;
  const int fd =
      SendPost("/v1/completions", R"({"model":"m","prompt":"x","max_tokens":3,"stream":true})");
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(fake_.AwaitStarted(1));
  close(fd);
  EXPECT_TRUE(fake_.AwaitCancelled(1)) << "the call outlived its client";
  fake_.Release();
}

// A client that hangs up while its prompt is being tokenized stops the tokenization at its next
// check, and no call starts.
TEST_F(OpenAiHttpGuardTest, HangUpWhileTokenizingStopsIt) {
  testing::GatedTokenizer gated;
  StartHttp(DefaultOptions(), &gated);
  const int fd = SendPost("/v1/completions", R"({"model":"m","prompt":"x","max_tokens":1})");
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(gated.AwaitEntered(1));
  close(fd);
  std::vector<absl::Status> gave_up = gated.AwaitGaveUp();
  ASSERT_EQ(gave_up.size(), 1u);
  EXPECT_EQ(gave_up[0].code(), absl::StatusCode::kCancelled) << gave_up[0];
  http_.reset();
  EXPECT_EQ(fake_.Started(), 0);
}

// One address holding idle connections beyond its limit gets the extra ones closed at accept
// (counted, logged); everyone else, /health included, is still served at once (before: 1,024
// idle connections locked the API out until they timed out, 60 s, without a log line).
TEST_F(OpenAiHttpGuardTest, IdleConnectionsFromOneAddressCannotLockOthersOut) {
  HttpServerOptions options = DefaultOptions();
  options.limits.total = 12;
  options.limits.per_client = 4;
  options.idle_timeout_s = 3600;  // idle ones stay: only the limits are at work here
  std::vector<std::string> lines;
  absl::Mutex lines_mu;
  options.log = [&](const std::string& line) {
    absl::MutexLock lock(&lines_mu);
    lines.push_back(line);
  };
  StartHttp(options);
  std::vector<int> idle;
  for (int i = 0; i < 12; ++i) {
    const int fd = testing::ConnectLoopback(http_->port(), "127.0.0.2");
    ASSERT_GE(fd, 0) << "cannot bind 127.0.0.2 (Linux routes all of 127/8 to loopback)";
    idle.push_back(fd);
  }
  EXPECT_TRUE(AwaitCounter(metrics::names::kRouterHttpConnectionsRefusedTotal, "per_client", 8));
  EXPECT_EQ(Counter(metrics::names::kRouterHttpConnectionsRefusedTotal, "total"), 0);
  EXPECT_THAT(testing::StatusLine(Health()), StartsWith("HTTP/1.1 200"));
  StreamBytes("ok");
  auto body = PostJsonToLoopback(http_->port(), "/v1/completions",
                                 R"({"model":"m","prompt":"x","max_tokens":2})", kPatience);
  EXPECT_TRUE(body.ok()) << body.status();
  {
    absl::MutexLock lock(&lines_mu);
    ASSERT_FALSE(lines.empty());
    EXPECT_THAT(lines[0], HasSubstr("--http-max-connections-per-client 4"));
    EXPECT_THAT(lines[0], HasSubstr("127.0.0.2"));
    EXPECT_LT(lines.size(), 3u) << "the log is rate-limited";
  }
  for (int fd : idle) close(fd);
}

// An idle connection is closed after the idle timeout; connections waiting for their first token
// (a stream and a whole answer, both suspended) outlive it and are answered in full.
TEST_F(OpenAiHttpGuardTest, IdleConnectionsCloseButWaitingOnesDoNot) {
  HttpServerOptions options = DefaultOptions();
  options.idle_timeout_s = 1;
  StartHttp(options);
  StreamBytes("hello");
  fake_.hold_first = true;
  absl::StatusOr<std::string> streamed, whole;
  std::thread stream, answer;
  absl::Cleanup end = [&] {  // whatever fails, the waiting requests end before the test does
    fake_.Release();
    if (stream.joinable()) stream.join();
    if (answer.joinable()) answer.join();
  };
  stream = std::thread([&] {
    streamed = PostJsonToLoopback(http_->port(), "/v1/completions",
                                  R"({"model":"m","prompt":"x","max_tokens":5,"stream":true})",
                                  2 * kPatience);
  });
  answer = std::thread([&] {
    whole = PostJsonToLoopback(http_->port(), "/v1/completions",
                               R"({"model":"m","prompt":"x","max_tokens":5})", 2 * kPatience);
  });
  ASSERT_TRUE(fake_.AwaitStarted(2));
  // Connected after both waiting ones: its closing proves they waited longer than the timeout.
  const int idle = testing::ConnectLoopback(http_->port());
  ASSERT_GE(idle, 0);
  EXPECT_TRUE(AwaitClosedByServer(idle)) << "an idle connection was kept";
  close(idle);
  std::move(end).Invoke();
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_THAT(*streamed, HasSubstr("[DONE]"));
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(nlohmann::json::parse(*whole)["choices"][0]["text"], "hello");
}

// Tokenization runs on workers: while one prompt is stuck tokenizing, /health and other requests
// are answered (before: the polling thread tokenized, and every connection waited 21-120 s).
TEST_F(OpenAiHttpGuardTest, TokenizationRunsOffThePollingThread) {
  testing::GatedTokenizer gated;
  HttpServerOptions options = DefaultOptions();
  options.workers = 2;
  StartHttp(options, &gated);
  StreamBytes("ok");
  absl::StatusOr<std::string> stuck;
  std::thread a;
  absl::Cleanup end = [&] {  // whatever fails, the blocked request ends before the test does
    gated.Release();
    if (a.joinable()) a.join();
  };
  a = std::thread([&] {
    stuck = PostJsonToLoopback(http_->port(), "/v1/completions",
                               R"({"model":"m","prompt":"x","max_tokens":2})", 2 * kPatience);
  });
  ASSERT_TRUE(gated.AwaitEntered(1));
  EXPECT_THAT(testing::StatusLine(Health()), StartsWith("HTTP/1.1 200"));
  // Token ids need no tokenizing, only a worker: the second one is free.
  auto ids = PostJsonToLoopback(http_->port(), "/v1/completions",
                                R"({"model":"m","prompt":[120,121],"max_tokens":2})", kPatience);
  EXPECT_TRUE(ids.ok()) << ids.status();
  std::move(end).Invoke();
  EXPECT_TRUE(stuck.ok()) << stuck.status();
}

// With every worker busy and the queue full, a request gets 429 with Retry-After at once (the
// queue's own bound is WorkerPoolTest's).
TEST_F(OpenAiHttpGuardTest, AFullWorkQueueIsRefusedWith429) {
  testing::GatedTokenizer gated;
  HttpServerOptions options = DefaultOptions();
  options.workers = 1;
  options.max_queued = 0;
  StartHttp(options, &gated);
  StreamBytes("ok");
  const std::string text = R"({"model":"m","prompt":"x","max_tokens":2})";
  absl::StatusOr<std::string> stuck;
  std::thread a;
  absl::Cleanup end = [&] {
    gated.Release();
    if (a.joinable()) a.join();
  };
  a = std::thread(
      [&] { stuck = PostJsonToLoopback(http_->port(), "/v1/completions", text, 2 * kPatience); });
  ASSERT_TRUE(gated.AwaitEntered(1));
  const int fd = SendPost("/v1/completions", text);
  ASSERT_GE(fd, 0);
  const std::string refused = testing::ReadUntil(fd, "--http-max-queued", kPatience);
  close(fd);
  EXPECT_THAT(testing::StatusLine(refused), StartsWith("HTTP/1.1 429")) << refused;
  EXPECT_THAT(refused, HasSubstr("Retry-After: 1"));
  EXPECT_THAT(refused, HasSubstr("rate_limit_error"));
  EXPECT_EQ(Counter(metrics::names::kRouterHttpRequestsShedTotal, "work_queue_full"), 1);
  std::move(end).Invoke();
  EXPECT_TRUE(stuck.ok()) << stuck.status();
}

// One request's tokenization is bounded: past --http-tokenize-timeout-ms it is refused with 400
// saying so (a hostile text or tokenizer.json cannot hold a worker for long).
TEST_F(OpenAiHttpGuardTest, TokenizationPastTheTimeoutIsRefused) {
  testing::GatedTokenizer gated;  // never released
  HttpServerOptions options = DefaultOptions();
  options.tokenize_timeout = absl::Milliseconds(200);
  StartHttp(options, &gated);
  auto body = PostJsonToLoopback(http_->port(), "/v1/completions",
                                 R"({"model":"m","prompt":"x","max_tokens":2})", kPatience);
  ASSERT_FALSE(body.ok());
  EXPECT_THAT(body.status().message(), HasSubstr("HTTP 400"));
  EXPECT_THAT(body.status().message(), HasSubstr("--http-tokenize-timeout-ms"));
  EXPECT_THAT(body.status().message(), HasSubstr("\"param\":\"prompt\""));
  EXPECT_EQ(fake_.Started(), 0);
}

// Stopping the server answers the requests still waiting 503 (not a bare cancellation) and
// cancels their calls.
TEST_F(OpenAiHttpGuardTest, StoppingAnswersOpenRequestsWith503) {
  StreamBytes("never");
  fake_.hold_first = true;
  absl::StatusOr<std::string> body;
  std::thread client;
  absl::Cleanup end = [&] {
    http_.reset();
    if (client.joinable()) client.join();
  };
  client = std::thread([&, port = http_->port()] {
    body = PostJsonToLoopback(port, "/v1/completions",
                              R"({"model":"m","prompt":"x","max_tokens":5})", 2 * kPatience);
  });
  ASSERT_TRUE(fake_.AwaitStarted(1));
  std::move(end).Invoke();
  ASSERT_FALSE(body.ok());
  const std::string message(body.status().message());
  EXPECT_THAT(message, HasSubstr("HTTP 503"));
  EXPECT_THAT(message, HasSubstr("shutting down"));
  EXPECT_TRUE(fake_.AwaitCancelled(1));
}

// Permanent refusals are 400 invalid_request_error without Retry-After; 429 is for "try later".
TEST_F(OpenAiHttpGuardTest, PermanentRefusalsAre400NotRetryable429) {
  // A prompt larger than every decode node's KV arena (decode/kv/kv_admission.cc's OUT_OF_RANGE).
  fake_.reject = grpc::Status(grpc::StatusCode::OUT_OF_RANGE,
                              "the request needs 900 KV pages ... can never admit it: shorten the "
                              "prompt or send it to a node with a larger arena (--kv-pages)");
  const int fd = SendPost("/v1/completions", R"({"model":"m","prompt":"x"})");
  ASSERT_GE(fd, 0);
  const std::string answer = testing::ReadUntil(fd, "--kv-pages", kPatience);  // keep-alive
  close(fd);
  EXPECT_THAT(testing::StatusLine(answer), StartsWith("HTTP/1.1 400")) << answer;
  EXPECT_THAT(answer, HasSubstr("invalid_request_error"));
  EXPECT_THAT(answer, Not(HasSubstr("Retry-After")));

  // A text the tokenizer's pre-tokenizer regex gives up on (PCRE2's match limit).
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = '!'; b <= '~'; ++b) vocab[std::string(1, static_cast<char>(b))] = b;
  nlohmann::json j;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}};
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       nlohmann::json::array(
           {{{"type", "Split"},
             {"pattern", {{"Regex", "(?:a+)+b|a"}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  j["decoder"] = {{"type", "ByteLevel"}};
  auto hostile = model::HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(hostile.ok()) << hostile.status();
  StartHttp(DefaultOptions(), hostile->get());
  fake_.reject = grpc::Status::OK;
  auto body = PostJsonToLoopback(
      http_->port(), "/v1/completions",
      absl::StrCat(R"({"model":"m","max_tokens":1,"prompt":")", std::string(64, 'a'), "\"}"),
      kPatience);
  ASSERT_FALSE(body.ok());
  EXPECT_THAT(body.status().message(), HasSubstr("HTTP 400"));
  EXPECT_THAT(body.status().message(), HasSubstr("gave up after"));
  EXPECT_EQ(fake_.Started(), 1);  // only the first request reached the router
}

}  // namespace
}  // namespace fluxion::cluster::openai
