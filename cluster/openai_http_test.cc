// The HTTP server and the Generate bridge in one process, against a fake DecodeService that
// streams fixed byte-tokenizer ids one per chunk: SSE framing of a stream whose characters and
// stop string span tokens, the cancellation a stop string causes, and a refusal before the first
// token becoming 429 with Retry-After.
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

// Streams `ids` one per chunk (or refuses with `reject`), and records whether the client
// cancelled.
class FakeDecode final : public v1::DecodeService::Service {
 public:
  std::vector<uint32_t> ids;
  grpc::Status reject = grpc::Status::OK;
  bool wait_for_cancel = false;  // after the ids, wait (bounded) for the client to cancel
  // After the complete message, hold the status back until the client cancels (bounded).
  bool hold_status = false;

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest*,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    if (!reject.ok()) return reject;
    uint32_t sent = 0;
    for (uint32_t id : ids) {
      v1::GenerateResponse r;
      r.mutable_chunk()->add_token_ids(id);
      r.mutable_chunk()->set_completion_tokens(++sent);
      if (!writer->Write(r)) break;
    }
    // Wait (bounded) for a cancellation that a stop string causes, before completing.
    for (int i = 0; wait_for_cancel && i < 6000 && !context->IsCancelled(); ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    if (context->IsCancelled()) {
      absl::MutexLock lock(&mu);
      ++cancelled;
      return grpc::Status::CANCELLED;
    }
    v1::GenerateResponse done;
    done.mutable_complete()->set_finish_reason(v1::FINISH_REASON_LENGTH);
    done.mutable_complete()->mutable_usage()->set_completion_tokens(sent);
    writer->Write(done);
    for (int i = 0; hold_status && i < 6000 && !context->IsCancelled(); ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    if (context->IsCancelled()) {
      absl::MutexLock lock(&mu);
      ++cancelled;
      return grpc::Status::CANCELLED;
    }
    return grpc::Status::OK;
  }

  int Cancelled() {
    absl::MutexLock lock(&mu);
    return cancelled;
  }
  // Whether `n` calls were cancelled within 30 s (cancellation travels asynchronously).
  bool AwaitCancelled(int n) {
    absl::MutexLock lock(&mu);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return cancelled >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(30));
  }

 private:
  absl::Mutex mu;
  int cancelled ABSL_GUARDED_BY(mu) = 0;
};

class OpenAiHttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    HttpServerOptions options;
    options.model_name = "m";
    std::shared_ptr<grpc::Channel> channel = server_->InProcessChannel(grpc::ChannelArguments());
    channel_ = channel;
    auto http = HttpServer::Start("127.0.0.1:0", std::move(channel), tokenizer_.get(), nullptr,
                                  options);
    ASSERT_TRUE(http.ok()) << http.status();
    http_ = std::move(*http);
  }
  void TearDown() override {
    http_.reset();
    server_->Shutdown();
  }
  void StreamBytes(const std::string& text) {
    fake_.ids.clear();
    for (unsigned char c : text) fake_.ids.push_back(c);
  }
  // The events of an SSE body, "data: " stripped.
  static std::vector<std::string> Events(const std::string& body) {
    std::vector<std::string> events;
    for (absl::string_view e : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
      EXPECT_EQ(e.substr(0, 6), "data: ") << e;
      events.emplace_back(e.substr(6));
    }
    return events;
  }

  FakeDecode fake_;
  std::unique_ptr<grpc::Server> server_;
  std::weak_ptr<grpc::Channel> channel_;  // the HTTP server owns it
  std::unique_ptr<model::Tokenizer> tokenizer_ = model::NewByteTokenizer();
  std::unique_ptr<HttpServer> http_;
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

// Requests a proxy in front could frame differently are refused before their body is read, and
// the connection is closed: conflicting Content-Length (the old server took the first), a
// Transfer-Encoding other than "chunked" (the old server read such a body until the connection
// closed, so the request hung), both Content-Length and Transfer-Encoding.
TEST_F(OpenAiHttpTest, AmbiguousFramingIsRefusedBeforeTheBody) {
  StreamBytes("ok");
  const std::string body = R"({"model":"m","prompt":"x","max_tokens":2})";
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: a\r\n"
                           "Content-Type: application/json\r\n";
  const std::string chunked = absl::StrCat(absl::Hex(body.size()), "\r\n", body, "\r\n0\r\n\r\n");
  struct Case {
    std::string name;
    std::string request;
    std::string status;
  };
  const std::vector<Case> cases = {
      {"conflicting lengths",
       absl::StrCat(head, "Content-Length: ", body.size(), "\r\nContent-Length: ",
                    body.size() + 8, "\r\n\r\n", body, "{\"x\":1}"),
       "HTTP/1.1 400"},
      {"chunked, identity",
       absl::StrCat(head, "Transfer-Encoding: chunked, identity\r\n\r\n", chunked),
       "HTTP/1.1 400"},
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
