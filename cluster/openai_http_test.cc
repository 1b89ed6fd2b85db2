// The HTTP server and the Generate bridge in one process, against a fake DecodeService that
// streams fixed byte-tokenizer ids one per chunk (openai_http_testing.h): SSE framing of a stream
// whose characters and stop string span tokens, the cancellation a stop string causes, a refusal
// before the first token becoming 429 with Retry-After, the channel's lifetime, request framing.
// The hardening against careless or hostile clients is openai_http_guard_test.cc.
#include "cluster/openai_http.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cluster/http_testing.h"
#include "cluster/openai_client.h"
#include "cluster/openai_http_testing.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster::openai {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class OpenAiHttpTest : public testing::OpenAiHttpFixture {
 protected:
  // The events of an SSE body, "data: " stripped.
  static std::vector<std::string> Events(const std::string& body) {
    std::vector<std::string> events;
    for (absl::string_view e : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
      EXPECT_EQ(e.substr(0, 6), "data: ") << e;
      events.emplace_back(e.substr(6));
    }
    return events;
  }
};

TEST_F(OpenAiHttpTest, StreamSplitsNoCharacterAndStopsBeforeTheStopString) {
  // "é" and "😀" arrive one byte per chunk; the stop string "END" spans three chunks.
  StreamBytes("caf\xc3\xa9 \xf0\x9f\x98\x80 ok END never sent");
  fake_.wait_for_cancel = true;
  auto body =
      PostJsonToLoopback(http_->port(), "/v1/completions",
                         R"({"model":"m","prompt":"x","max_tokens":64,"stream":true,"stop":"END",
          "stream_options":{"include_usage":true}})",
                         absl::Seconds(10));
  ASSERT_TRUE(body.ok()) << body.status();
  std::vector<std::string> events = Events(*body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text, finish;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    auto j = nlohmann::json::parse(events[i]);  // throws (fails the test) on broken UTF-8
    if (j.contains("usage") && !j["usage"].is_null()) {
      EXPECT_TRUE(j["choices"].empty());
      EXPECT_EQ(j["usage"]["completion_tokens"], 17);  // bytes up to and including the "D"
      continue;
    }
    const auto& choice = j["choices"][0];
    const std::string piece = choice["text"];
    EXPECT_TRUE(model::IsValidUtf8(piece));
    text += piece;
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
  }
  EXPECT_EQ(text, "caf\xc3\xa9 \xf0\x9f\x98\x80 ok ");
  EXPECT_EQ(finish, "stop");
  // The stop string cancelled the generation.
  EXPECT_TRUE(fake_.AwaitCancelled(1));
  EXPECT_EQ(fake_.Cancelled(), 1);
}

TEST_F(OpenAiHttpTest, WholeAnswerWithoutStop) {
  StreamBytes("hello");
  auto body = PostJsonToLoopback(http_->port(), "/v1/completions",
                                 R"({"model":"m","prompt":"x","max_tokens":5})", absl::Seconds(10));
  ASSERT_TRUE(body.ok()) << body.status();
  auto j = nlohmann::json::parse(*body);
  EXPECT_EQ(j["choices"][0]["text"], "hello");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 1);
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);
}

// A whole answer goes out at the complete message, before the call's status. Destroying the
// server then must end that call and drop the channel itself: were the channel's last reference
// dropped by the call's own OnDone, on a thread of gRPC's callback completion queue, the channel
// would shut that queue down from one of its own threads (gRPC 1.51 then aborts in
// grpc_cq_internal_unref: "ref_counted.h:183 assertion failed: prior > 0").
TEST_F(OpenAiHttpTest, TheServerDropsItsChannelAfterItsLastCallEnds) {
  StreamBytes("hi");
  fake_.hold_status = true;
  auto body = PostJsonToLoopback(http_->port(), "/v1/completions",
                                 R"({"model":"m","prompt":"x","max_tokens":2})", absl::Seconds(30));
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(nlohmann::json::parse(*body)["choices"][0]["text"], "hi");
  http_.reset();
  EXPECT_TRUE(channel_.expired()) << "a call outlived the server and holds its channel";
  EXPECT_TRUE(fake_.AwaitCancelled(1));
}

TEST_F(OpenAiHttpTest, RefusalBeforeTheFirstTokenIsAnHttpStatus) {
  fake_.reject = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "all nodes full");
  auto body = PostJsonToLoopback(http_->port(), "/v1/completions",
                                 R"({"model":"m","prompt":"x","stream":true})", absl::Seconds(10));
  ASSERT_FALSE(body.ok());
  EXPECT_THAT(body.status().message(), HasSubstr("429"));
  EXPECT_THAT(body.status().message(), HasSubstr("all nodes full"));
  fake_.reject = grpc::Status(grpc::StatusCode::UNAVAILABLE, "no decode node");
  body = PostJsonToLoopback(http_->port(), "/v1/completions", R"({"model":"m","prompt":"x"})",
                            absl::Seconds(10));
  ASSERT_FALSE(body.ok());
  EXPECT_THAT(body.status().message(), HasSubstr("503"));
}

// One failed choice of several decides the answer (its status) and cancels the others, whose
// pages must not stay taken by an answer nobody reads.
TEST_F(OpenAiHttpTest, OneChoiceRefusedIsTheAnswerAndTheOthersAreCancelled) {
  StreamBytes("hi");
  fake_.hold_first = true;  // the choices that are not refused wait before their first token
  fake_.reject = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "this one is full");
  fake_.reject_only_suffix = ".2";
  auto body = PostJsonToLoopback(http_->port(), "/v1/completions",
                                 R"({"model":"m","prompt":"x","max_tokens":2,"n":3})",
                                 absl::Seconds(30));
  ASSERT_FALSE(body.ok());
  EXPECT_THAT(body.status().message(), HasSubstr("429"));
  EXPECT_THAT(body.status().message(), HasSubstr("this one is full"));
  EXPECT_TRUE(fake_.AwaitCancelled(2));
}

// Requests a proxy in front could frame differently are refused before their body is read, and
// the connection is closed: conflicting Content-Length (the old server took the first), a
// Transfer-Encoding other than "chunked" (the old server read such a body until the connection
// closed, so the request hung), both Content-Length and Transfer-Encoding.
TEST_F(OpenAiHttpTest, AmbiguousFramingIsRefusedBeforeTheBody) {
  StreamBytes("ok");
  const std::string body = R"({"model":"m","prompt":"x","max_tokens":2})";
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: a\r\n"
      "Content-Type: application/json\r\n";
  const std::string chunked = absl::StrCat(absl::Hex(body.size()), "\r\n", body, "\r\n0\r\n\r\n");
  struct Case {
    std::string name;
    std::string request;
    std::string status;
  };
  const std::vector<Case> cases = {
      {"conflicting lengths",
       absl::StrCat(head, "Content-Length: ", body.size(), "\r\nContent-Length: ", body.size() + 8,
                    "\r\n\r\n", body, "{\"x\":1}"),
       "HTTP/1.1 400"},
      {"chunked, identity",
       absl::StrCat(head, "Transfer-Encoding: chunked, identity\r\n\r\n", chunked), "HTTP/1.1 400"},
      {"two Transfer-Encoding lines",
       absl::StrCat(head, "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
                    chunked),
       "HTTP/1.1 400"},
      {"length and chunked",
       absl::StrCat(head, "Content-Length: ", chunked.size(),
                    "\r\nTransfer-Encoding: chunked\r\n\r\n", chunked),
       "HTTP/1.1 400"},
      // Still served: the same length twice (RFC 9112 6.3), and plain chunked.
      {"equal lengths",
       absl::StrCat(head, "Content-Length: ", body.size(), "\r\nContent-Length: ", body.size(),
                    "\r\nConnection: close\r\n\r\n", body),
       "HTTP/1.1 200"},
      {"chunked",
       absl::StrCat(head, "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n", chunked),
       "HTTP/1.1 200"},
  };
  for (const Case& c : cases) {
    const int fd = testing::ConnectLoopback(http_->port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(testing::SendAll(fd, c.request)) << c.name;
    // The server closes the connection after its answer; a hang shows as an empty answer.
    const std::string answer = testing::ReadUntilClose(fd, absl::Seconds(30));
    close(fd);
    EXPECT_THAT(testing::StatusLine(answer), StartsWith(c.status)) << c.name << ": " << answer;
    if (c.status == "HTTP/1.1 400") {
      EXPECT_THAT(answer, HasSubstr("invalid_request_error")) << c.name;
      EXPECT_THAT(answer, HasSubstr("Connection: close")) << c.name;
    }
  }
}

}  // namespace
TEST(OpenAiClientTest, NoServerIsUnavailableAndASilentOneTimesOut) {
  // A port nothing listens on: bind one and close it again.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  auto refused = PostJsonToLoopback(port, "/v1/completions", "{}", absl::Seconds(5));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr(absl::StrCat("127.0.0.1:", port)));
  // Listening but never answering: the timeout ends the call.
  ASSERT_EQ(listen(fd, 4), 0);
  auto silent = PostJsonToLoopback(port, "/v1/completions", "{}", absl::Milliseconds(300));
  EXPECT_EQ(silent.status().code(), absl::StatusCode::kDeadlineExceeded) << silent.status();
  close(fd);
}

}  // namespace fluxion::cluster::openai
