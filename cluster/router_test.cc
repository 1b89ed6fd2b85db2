// The router over real gRPC on loopback, in front of in-test fake decode and prefill nodes
// (cluster/fake_decode_service.h).
#include <chrono>
#include <thread>

#include "cluster/backends.h"
#include "cluster/fake_decode_service.h"
#include "cluster/replayer.h"
#include "cluster/router_service.h"
#include "common/metrics_http.h"
#include "common/metrics_testing.h"
#include "common/peer_failure.h"
#include "common/wait_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::FakeDecodeService;
using testing::FakePrefillService;
using testing::FakeServer;

v1::DecodeLoad Load(uint64_t free_pages, uint32_t running, float kv_usage) {
  v1::DecodeLoad l;
  l.set_free_kv_pages(free_pages);
  l.set_total_kv_pages(1000);
  l.set_page_tokens(16);
  l.set_running_requests(running);
  l.set_kv_usage(kv_usage);
  l.set_admittable_prompt_tokens(1 << 20);
  l.mutable_server()->set_role(v1::SERVER_ROLE_DECODE);
  return l;
}

struct Result {
  grpc::Status status;
  std::vector<uint32_t> tokens;
  std::vector<v1::GenerateResponse> messages;
};

// Two decode nodes (a: 10% free, b: 90% free, so b is picked first), two prefill nodes (p2 has
// the shorter queue), and the router in front.
class RouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    decode_a_.SetLoad(Load(100, 0, 0.9f));
    decode_b_.SetLoad(Load(900, 0, 0.1f));
    v1::PrefillLoad p1, p2;
    p1.set_queued_prompt_tokens(5000);
    p2.set_queued_prompt_tokens(10);
    prefill_1_.SetLoad(p1);
    prefill_2_.SetLoad(p2);
    a_ = std::make_unique<FakeServer>(&decode_a_, "fluxion.v1.DecodeService");
    b_ = std::make_unique<FakeServer>(&decode_b_, "fluxion.v1.DecodeService");
    p1_ = std::make_unique<FakeServer>(&prefill_1_, "fluxion.v1.PrefillService");
    p2_ = std::make_unique<FakeServer>(&prefill_2_, "fluxion.v1.PrefillService");
    StartRouter({a_->address(), b_->address()}, {p1_->address(), p2_->address()});
  }

  void StartRouter(std::vector<std::string> decodes, std::vector<std::string> prefills,
                   std::vector<std::string> decode_dns = {}) {
    Backends::Options o;
    o.decode_addresses = std::move(decodes);
    o.prefill_addresses = std::move(prefills);
    o.decode_dns = std::move(decode_dns);
    o.start_poller = false;  // tests poll explicitly, so what the router knows is deterministic
    auto backends = Backends::Create(o);
    ASSERT_TRUE(backends.ok()) << backends.status();
    backends_ = std::move(*backends);
    RouterOptions ro;
    ro.shed_kv_usage = 0.95;
    service_ = std::make_unique<RouterService>(backends_.get(), ro, &registry_);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    router_ = builder.BuildAndStart();
    router_address_ = "127.0.0.1:" + std::to_string(port);
    stub_ = v1::DecodeService::NewStub(
        grpc::CreateChannel(router_address_, grpc::InsecureChannelCredentials()));
  }

  void TearDown() override { StopRouter(); }

  void StopRouter() {
    if (router_) {
      router_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      router_->Wait();
      router_.reset();
    }
  }

  // The abort token the server sent for `context`'s call (waits for its initial metadata).
  static std::string AbortToken(grpc::ClientContext& context,
                                grpc::ClientReader<v1::GenerateResponse>& reader) {
    reader.WaitForInitialMetadata();
    auto it = context.GetServerInitialMetadata().find("fluxion-abort-token");
    if (it == context.GetServerInitialMetadata().end()) return "";
    return std::string(it->second.data(), it->second.size());
  }

  v1::AbortResponse Abort(const std::string& id, const std::string& token) {
    grpc::ClientContext context;
    v1::AbortRequest abort;
    abort.add_request_ids(id);
    if (!token.empty()) abort.add_abort_tokens(token);
    abort.set_reason("test");
    v1::AbortResponse response;
    EXPECT_TRUE(stub_->Abort(&context, abort, &response).ok());
    return response;
  }

  static v1::GenerateRequest Request(const std::string& id, uint32_t max_tokens) {
    v1::GenerateRequest r;
    r.set_request_id(id);
    for (uint32_t t : {5u, 6u, 7u}) r.add_prompt_token_ids(t);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    return r;
  }

  Result Generate(const v1::GenerateRequest& request,
                  std::chrono::milliseconds deadline = std::chrono::seconds(60)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    Result result;
    auto reader = stub_->Generate(&context, request);
    v1::GenerateResponse response;
    while (reader->Read(&response)) {
      for (uint32_t t : response.chunk().token_ids()) result.tokens.push_back(t);
      result.messages.push_back(response);
    }
    result.status = reader->Finish();
    return result;
  }

  double Counter(const std::string& name, const metrics::Labels& labels) {
    return registry_.AddCounter(name, "", labels)->value();
  }

  FakeDecodeService decode_a_, decode_b_;
  FakePrefillService prefill_1_, prefill_2_;
  std::unique_ptr<FakeServer> a_, b_, p1_, p2_;
  metrics::Registry registry_;
  std::unique_ptr<Backends> backends_;
  std::unique_ptr<RouterService> service_;
  std::unique_ptr<grpc::Server> router_;
  std::string router_address_;
  std::unique_ptr<v1::DecodeService::Stub> stub_;
};

TEST_F(RouterTest, ForwardsToTheFreestDecodeNodeNamingTheLeastQueuedPrefillNode) {
  Result r = Generate(Request("r-1", 4));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, (std::vector<uint32_t>{100, 101, 102, 103}));
  ASSERT_TRUE(r.messages.back().has_complete());
  ASSERT_EQ(decode_b_.seen().size(), 1u);
  EXPECT_TRUE(decode_a_.seen().empty());
  const v1::GenerateRequest forwarded = decode_b_.seen()[0].request;
  EXPECT_EQ(forwarded.request_id(), "r-1");
  EXPECT_EQ(forwarded.prefill_address(), p2_->address());
  EXPECT_EQ(forwarded.prompt_token_ids_size(), 3);
}

TEST_F(RouterTest, FailureBeforeTheFirstTokenIsRetriedOnAnotherPair) {
  FakeDecodeService::Behaviour reject;
  reject.reject = [](const v1::GenerateRequest&) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake: prefill peer died");
  };
  decode_b_.SetBehaviour(reject);
  Result r = Generate(Request("r-2", 3));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 3u);
  ASSERT_EQ(decode_b_.seen().size(), 1u);
  ASSERT_EQ(decode_a_.seen().size(), 1u);
  EXPECT_EQ(decode_a_.seen()[0].request.request_id(), "r-2");  // the id travels unchanged
  // Another pair: the first prefill choice (p2) is not reused while p1 is healthy.
  EXPECT_EQ(decode_a_.seen()[0].request.prefill_address(), p1_->address());
  EXPECT_EQ(Counter("fluxion_router_attempts_total", {{"outcome", "retried"}}), 1);
}

// A decode node that answers with its prefill peer's failure (UNAVAILABLE, no message, the error
// naming the prefill node: common/peer_failure.h) is reachable: the router ejects the prefill
// node, not the decode node, which stays in for other pairs. An error that names no prefill node
// ejects the decode node as before.
TEST_F(RouterTest, APrefillPeersFailureEjectsThePrefillNodeNotTheDecodeNode) {
  FakeDecodeService::Behaviour reject;
  const std::string dead_prefill = p2_->address();
  reject.reject = [dead_prefill](const v1::GenerateRequest& r) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        PrefillFailureMessage(r.prefill_address(), "Socket closed"));
  };
  decode_b_.SetBehaviour(reject);
  Result r = Generate(Request("r-peer", 3));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(decode_b_.seen().size(), 1u);
  EXPECT_EQ(decode_b_.seen()[0].request.prefill_address(), dead_prefill);
  EXPECT_EQ(backends_->HealthyCount(Role::kDecode), 2);
  EXPECT_EQ(backends_->HealthyCount(Role::kPrefill), 1);

  FakeDecodeService::Behaviour unreachable;
  unreachable.reject = [](const v1::GenerateRequest&) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake: connection reset");
  };
  decode_b_.SetBehaviour(unreachable);
  Result again = Generate(Request("r-peer-2", 3));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(backends_->HealthyCount(Role::kDecode), 1);
}

TEST_F(RouterTest, FailureAfterTheFirstTokenIsRelayedNotRetried) {
  FakeDecodeService::Behaviour fail;
  fail.fail_after_tokens = 2;
  decode_b_.SetBehaviour(fail);
  Result r = Generate(Request("r-3", 10));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(r.status.error_message(), HasSubstr("after the first token"));
  EXPECT_EQ(r.tokens.size(), 2u);
  ASSERT_TRUE(r.messages.back().has_error());
  EXPECT_TRUE(decode_a_.seen().empty());
}

TEST_F(RouterTest, RetriesStopAfterMaxAttemptsWithTheLastError) {
  FakeDecodeService::Behaviour reject;
  reject.reject = [](const v1::GenerateRequest&) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "fake: no pages");
  };
  decode_a_.SetBehaviour(reject);
  decode_b_.SetBehaviour(reject);
  Result r = Generate(Request("r-4", 3));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(r.status.error_message(), HasSubstr("fake: no pages"));
  // The nodes' addresses are the router's own business (its log), not the client's.
  EXPECT_THAT(r.status.error_message(), Not(HasSubstr(a_->address())));
  EXPECT_THAT(r.status.error_message(), Not(HasSubstr(b_->address())));
  EXPECT_EQ(decode_a_.seen().size() + decode_b_.seen().size(), 2u);  // each node once
}

// A prompt that can never fit one decode node's arena (OUT_OF_RANGE) may fit another's: tried
// there; when no node takes it, the client gets OUT_OF_RANGE with the last node's message (a
// permanent answer: HTTP 400, not 429).
TEST_F(RouterTest, NeverFitsIsTriedOnAnotherNodeThenEndsOutOfRange) {
  FakeDecodeService::Behaviour small;
  small.reject = [](const v1::GenerateRequest&) {
    return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "fake: can never admit it (--kv-pages)");
  };
  decode_b_.SetBehaviour(small);
  Result served = Generate(Request("r-big", 3));
  EXPECT_TRUE(served.status.ok()) << served.status.error_message();
  EXPECT_EQ(decode_a_.seen().size(), 1u);  // b refused for good, a (larger) took it
  decode_a_.SetBehaviour(small);
  Result r = Generate(Request("r-bigger", 3));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(r.status.error_message(), HasSubstr("--kv-pages"));
  EXPECT_THAT(r.status.error_message(), Not(HasSubstr(a_->address())));
}

// A request the decode node refuses as invalid reaches the client with the node's own message
// (what the client must change), neither retried elsewhere nor naming the node.
TEST_F(RouterTest, AnInvalidRequestGetsTheNodesMessageAloneWithoutRetry) {
  FakeDecodeService::Behaviour invalid;
  invalid.reject = [](const v1::GenerateRequest&) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "This model's maximum context length is 8 tokens.");
  };
  decode_a_.SetBehaviour(invalid);
  decode_b_.SetBehaviour(invalid);
  Result r = Generate(Request("r-invalid", 3));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(),
            "request r-invalid: This model's maximum context length is 8 tokens.");
  EXPECT_EQ(decode_a_.seen().size() + decode_b_.seen().size(), 1u);
}

TEST_F(RouterTest, ShedsWithResourceExhaustedWhenEveryDecodeNodeIsAboveTheThreshold) {
  decode_a_.SetLoad(Load(20, 0, 0.98f));
  decode_b_.SetLoad(Load(30, 0, 0.97f));
  backends_->PollOnce();
  // Shed, not queued: a router that waited for room would end this call by its deadline (nothing
  // frees room here), and no decode node is asked.
  Result r = Generate(Request("r-5", 3));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(r.status.error_message(), HasSubstr("KV usage threshold"));
  EXPECT_TRUE(decode_a_.seen().empty());
  EXPECT_TRUE(decode_b_.seen().empty());
  EXPECT_EQ(registry_.AddCounter("fluxion_router_shed_total", "")->value(), 1);
}

TEST_F(RouterTest, KilledDecodeNodeFailsItsStreamClearlyAndNewRequestsGoElsewhere) {
  // An in-flight request on b fails with a clear error when b dies after the first token: b is
  // shut down once the first token has reached the client (so b had sent it).
  Result inflight;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub_->Generate(&context, Request("r-6", 500));
    v1::GenerateResponse response;
    while (inflight.tokens.empty() && reader->Read(&response)) {
      for (uint32_t t : response.chunk().token_ids()) inflight.tokens.push_back(t);
    }
    ASSERT_FALSE(inflight.tokens.empty()) << "no first token";
    b_->Shutdown();
    while (reader->Read(&response)) {
      for (uint32_t t : response.chunk().token_ids()) inflight.tokens.push_back(t);
    }
    inflight.status = reader->Finish();
  }
  EXPECT_FALSE(inflight.status.ok());
  EXPECT_GT(inflight.tokens.size(), 0u);
  EXPECT_THAT(inflight.status.error_message(), HasSubstr("after the first token"));
  EXPECT_THAT(inflight.status.error_message(), Not(HasSubstr(b_->address())))
      << "the node's address is the router's log's, not the client's";

  // b's load answer still looks best, but it is gone: the next request tries it, fails before
  // any token, and is served by a; after that the router avoids b.
  Result next = Generate(Request("r-7", 3));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(decode_a_.seen().size(), 1u);
  Result after = Generate(Request("r-8", 3));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(decode_a_.seen().size(), 2u);
  EXPECT_EQ(Counter("fluxion_router_attempts_total", {{"outcome", "retried"}}), 1);
  backends_->PollOnce();
  EXPECT_EQ(backends_->HealthyCount(Role::kDecode), 1);
}

TEST_F(RouterTest, UnhealthyNodeIsNotPicked) {
  b_->SetServing(false);
  backends_->PollOnce();
  Result r = Generate(Request("r-9", 2));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(decode_b_.seen().empty());
  EXPECT_EQ(decode_a_.seen().size(), 1u);
}

TEST_F(RouterTest, ClientCancellationReachesTheDecodeNode) {
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request("r-10", 500));
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  ASSERT_TRUE(reader->Read(&response));
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitFor([&] {
    auto seen = decode_b_.seen();
    return seen.size() == 1 && seen[0].cancelled;
  })) << "the decode node's call was not cancelled";
  EXPECT_TRUE(WaitFor([&] { return service_->inflight() == 0; }));
}

TEST_F(RouterTest, RemainingTimeBudgetAndDeadlineAreForwarded) {
  v1::GenerateRequest request = Request("r-11", 2);
  request.set_timeout_ms(60000);  // the 30 s gRPC deadline is earlier and wins
  const auto before = std::chrono::system_clock::now();
  Result r = Generate(request, std::chrono::seconds(30));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(decode_b_.seen().size(), 1u);
  const testing::SeenRequest seen = decode_b_.seen()[0];
  using std::chrono::milliseconds;
  // The client's deadline D lies in [before, received] + 30 s. gRPC sends a deadline as a relative
  // timeout that each hop re-anchors on arrival, rounded up to its encoding's unit (100 ms for
  // 10-100 s: kRounding per hop), so the budget the router had left is at most D - before plus
  // one rounding and at least D - received: bounds set by when things happened, whatever the
  // machine's speed (a router forwarding timeout_ms' 60 s breaks the upper one, one forwarding
  // nothing breaks both).
  constexpr int64_t kRounding = 100 + 1;
  const auto waited = std::chrono::duration_cast<milliseconds>(seen.received - before);
  EXPECT_LE(seen.request.timeout_ms(), 30000u + kRounding);
  EXPECT_GE(static_cast<int64_t>(seen.request.timeout_ms()), 30000 - waited.count() - 1);
  // The attempt's gRPC deadline is the budget plus the grace (500 ms by default), so the decode
  // node's own DEADLINE_EXCEEDED message would arrive first. Re-anchoring (two hops) can only move
  // it later, by at most the time the call took to arrive plus the roundings.
  const auto want = before + milliseconds(30500);
  EXPECT_GE(seen.deadline, want - milliseconds(1));
  EXPECT_LE(seen.deadline, want + waited + milliseconds(2 * kRounding));
}

TEST_F(RouterTest, DeadlineEndsTheRequestAndCancelsDownstream) {
  FakeDecodeService::Behaviour slow;
  slow.ttft = std::chrono::milliseconds(5000);
  decode_b_.SetBehaviour(slow);
  v1::GenerateRequest request = Request("r-12", 2);
  request.set_timeout_ms(300);
  // Ended by the router at the budget: had it waited for the node, the tokens would have come
  // after 5 s (long before the client's own 60 s deadline) and the call would have succeeded.
  Result r = Generate(request);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(r.tokens.empty());
  EXPECT_TRUE(WaitFor([&] {
    auto seen = decode_b_.seen();
    return seen.size() == 1 && seen[0].cancelled;
  }));
}

TEST_F(RouterTest, TimeBudgetRunningOutRelaysTheDecodeNodesErrorWithUsage) {
  // The decode node notices the budget 50 ms late (a real one polls every 20 ms). Its error
  // message must reach the client: the attempt's gRPC deadline must not fire first.
  FakeDecodeService::Behaviour slow;
  slow.itl = std::chrono::milliseconds(100);
  slow.timeout_noticed_late_ms = 50;
  decode_b_.SetBehaviour(slow);
  v1::GenerateRequest request = Request("r-budget", 500);
  request.set_timeout_ms(600);
  Result r = Generate(request);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << r.status.error_message();
  ASSERT_FALSE(r.messages.empty());
  ASSERT_TRUE(r.messages.back().has_error()) << "the in-stream error was lost";
  const v1::GenerateError& e = r.messages.back().error();
  EXPECT_EQ(e.code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(e.message(), HasSubstr("time budget"));
  EXPECT_GT(e.usage().completion_tokens(), 0u);
  EXPECT_EQ(e.usage().completion_tokens(), r.tokens.size());
  EXPECT_GT(e.timing().ttft_us(), 0u);
}

TEST_F(RouterTest, AbortIsForwardedToTheServingDecodeNodeWithItsToken) {
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request("r-13", 500));
  const std::string token = AbortToken(context, *reader);
  ASSERT_EQ(token.size(), 32u);  // 128 random bits, hex
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));  // the attempt is on b and has told its token
  ASSERT_TRUE(WaitFor([&] { return decode_b_.seen().size() == 1; }));

  // No token, a wrong one, an unknown id: all the same answer, and nothing goes downstream.
  EXPECT_EQ(Abort("r-13", "").aborted_request_ids_size(), 0);
  EXPECT_EQ(Abort("r-13", std::string(32, '0')).aborted_request_ids_size(), 0);
  EXPECT_EQ(Abort("unknown-id", token).aborted_request_ids_size(), 0);
  EXPECT_TRUE(decode_b_.abort_calls().empty());

  v1::AbortResponse aborted = Abort("r-13", token);
  ASSERT_EQ(aborted.aborted_request_ids_size(), 1);
  EXPECT_EQ(aborted.aborted_request_ids(0), "r-13");
  std::vector<v1::GenerateResponse> messages;
  while (reader->Read(&response)) messages.push_back(response);
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_FALSE(messages.empty());
  ASSERT_TRUE(messages.back().has_complete());
  EXPECT_EQ(messages.back().complete().finish_reason(), v1::FINISH_REASON_ABORT);
  // Forwarded with the decode node's own token, not the router's.
  const std::string downstream = decode_b_.seen()[0].abort_token;
  EXPECT_EQ(decode_b_.abort_calls(),
            (std::vector<std::pair<std::string, std::string>>{{"r-13", downstream}}));
  EXPECT_EQ(decode_b_.aborted(), std::vector<std::string>{"r-13"});
}

TEST_F(RouterTest, DuplicateIdsAreIndependentAndEachAbortNeedsItsOwnToken) {
  // Another client's id tells nothing: the same id may be live twice, and only the holder of a
  // call's token can abort that call.
  grpc::ClientContext c1, c2;
  auto r1 = stub_->Generate(&c1, Request("dup", 30));
  const std::string t1 = AbortToken(c1, *r1);
  auto r2 = stub_->Generate(&c2, Request("dup", 30));
  const std::string t2 = AbortToken(c2, *r2);
  ASSERT_FALSE(t1.empty());
  ASSERT_FALSE(t2.empty());
  EXPECT_NE(t1, t2);
  v1::GenerateResponse response;
  ASSERT_TRUE(r1->Read(&response));
  ASSERT_TRUE(r2->Read(&response));
  EXPECT_EQ(Abort("dup", t1).aborted_request_ids_size(), 1);
  std::vector<v1::GenerateResponse> m1, m2;
  while (r1->Read(&response)) m1.push_back(response);
  while (r2->Read(&response)) m2.push_back(response);
  ASSERT_TRUE(r1->Finish().ok());
  ASSERT_TRUE(r2->Finish().ok());
  ASSERT_FALSE(m1.empty());
  ASSERT_FALSE(m2.empty());
  EXPECT_EQ(m1.back().complete().finish_reason(), v1::FINISH_REASON_ABORT);
  EXPECT_EQ(m2.back().complete().finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(m2.back().complete().usage().completion_tokens(), 30u);
}

TEST_F(RouterTest, ClientChosenPrefillAddressMustBeOneOfTheRoutersOwn) {
  v1::GenerateRequest request = Request("r-pa", 2);
  request.set_prefill_address("10.9.9.9:7001");
  Result r = Generate(request);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(r.status.error_message(), HasSubstr("--prefill"));
  EXPECT_TRUE(decode_a_.seen().empty() && decode_b_.seen().empty());

  // One of its own pins the request to it (p2 would be picked by load).
  request.set_prefill_address(p1_->address());
  r = Generate(request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(decode_b_.seen().size(), 1u);
  EXPECT_EQ(decode_b_.seen()[0].request.prefill_address(), p1_->address());
}

TEST_F(RouterTest, RouterWithoutPrefillNodesForwardsNoClientChosenPrefillAddress) {
  StopRouter();
  StartRouter({a_->address(), b_->address()}, {});
  v1::GenerateRequest request = Request("r-pa2", 2);
  request.set_prefill_address(p1_->address());
  Result r = Generate(request);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(r.status.error_message(), HasSubstr("--prefill"));
  EXPECT_TRUE(decode_a_.seen().empty() && decode_b_.seen().empty());
  // Without the field the decode node uses its own configured prefill node.
  r = Generate(Request("r-pa3", 2));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(decode_b_.seen().size(), 1u);
  EXPECT_FALSE(decode_b_.seen()[0].request.has_prefill_address());
}

// The gateway's prefill pick (llm-d's x-prefiller-host-port) as call metadata: the request goes to
// that prefill node, not to the one the router's load view prefers (p2, the shorter queue).
Result GenerateWithMetadata(v1::DecodeService::Stub& stub, const v1::GenerateRequest& request,
                            const std::string& key, const std::string& value) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  context.AddMetadata(key, value);
  Result result;
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    for (uint32_t t : response.chunk().token_ids()) result.tokens.push_back(t);
  }
  result.status = reader->Finish();
  return result;
}

TEST_F(RouterTest, GatewayPrefillPickIsHonouredAmongOurPrefillNodes) {
  Result r = GenerateWithMetadata(*stub_, Request("g-1", 2), "x-prefiller-host-port",
                                  p1_->address());
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(decode_b_.seen().size(), 1u);
  EXPECT_EQ(decode_b_.seen()[0].request.prefill_address(), p1_->address());
  // The older header, a URL with the pod's HTTP port: both fakes listen on 127.0.0.1, so the host
  // alone names two prefill nodes: refused, naming the header.
  Result ambiguous = GenerateWithMetadata(*stub_, Request("g-2", 2), "x-prefiller-url",
                                          "http://127.0.0.1:8000");
  EXPECT_EQ(ambiguous.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(ambiguous.status.error_message(), HasSubstr("x-prefiller-url"));
  // Not one of ours: INVALID_ARGUMENT before anything is sent anywhere.
  Result unknown = GenerateWithMetadata(*stub_, Request("g-3", 2), "x-prefiller-host-port",
                                        "10.1.2.3:8000");
  EXPECT_EQ(unknown.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(unknown.status.error_message(), HasSubstr("names no prefill node of this router"));
  EXPECT_EQ(decode_a_.seen().size() + decode_b_.seen().size(), 1u);
  // Contradicting an explicit prefill_address: refused.
  v1::GenerateRequest both = Request("g-4", 2);
  both.set_prefill_address(p2_->address());
  Result conflict = GenerateWithMetadata(*stub_, both, "x-prefiller-host-port", p1_->address());
  EXPECT_EQ(conflict.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(RouterTest, GatewayPrefillPickThatIsUnhealthyFallsBackToTheRoutersPick) {
  p1_->SetServing(false);
  backends_->PollOnce();  // NOT_SERVING: dropped at once
  Result r = GenerateWithMetadata(*stub_, Request("g-5", 2), "x-prefiller-host-port",
                                  p1_->address());
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(decode_b_.seen().size(), 1u);
  EXPECT_EQ(decode_b_.seen()[0].request.prefill_address(), p2_->address());
}

TEST_F(RouterTest, GetLoadSumsHealthyDecodeNodes) {
  decode_a_.SetLoad(Load(100, 2, 0.9f));
  decode_b_.SetLoad(Load(900, 3, 0.1f));
  backends_->PollOnce();
  grpc::ClientContext context;
  v1::DecodeLoad load;
  ASSERT_TRUE(stub_->GetLoad(&context, v1::GetLoadRequest(), &load).ok());
  EXPECT_EQ(load.running_requests(), 5u);
  EXPECT_EQ(load.free_kv_pages(), 1000u);
  EXPECT_EQ(load.total_kv_pages(), 2000u);
  EXPECT_NEAR(load.kv_usage(), 0.5, 1e-6);
  EXPECT_EQ(load.server().role(), v1::SERVER_ROLE_ROUTER);
}

TEST_F(RouterTest, InvalidRequestIsRejectedWithoutForwarding) {
  Result r = Generate(Request("", 2));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(decode_a_.seen().empty() && decode_b_.seen().empty());
}

TEST_F(RouterTest, NewerProtocolVersionIsRefusedWithFailedPrecondition) {
  v1::GenerateRequest request = Request("r-15", 2);
  request.set_protocol_version(2);
  Result r = Generate(request);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(r.status.error_message(), HasSubstr("protocol_version 2"));
  EXPECT_TRUE(decode_a_.seen().empty() && decode_b_.seen().empty());
}

TEST_F(RouterTest, DozensOfReplayedRequestsAllSucceedAcrossBothNodes) {
  // The router's own picks spread load: requests sent since the last poll count against a node.
  Schedule schedule;
  for (int i = 0; i < 40; ++i) schedule.requests.push_back({i * 0.005, 16, 4, {}, i});
  ReplayOptions o;
  o.target = router_address_;
  o.progress = false;
  auto records = Replayer(o).Run(schedule);
  ASSERT_TRUE(records.ok()) << records.status();
  ReplayStats stats = ComputeStats(*records, Slo{});
  EXPECT_EQ(stats.succeeded, 40) << stats.errors_by_code.size();
  EXPECT_GT(decode_a_.seen().size(), 0u);
  EXPECT_GT(decode_b_.seen().size(), 0u);
}

TEST_F(RouterTest, ManyConcurrentStreamsAreRelayedCompletely) {
  // Stress for the relay's flow control and lifetimes: 300 streams, 64 at a time, 20 tokens each.
  FakeDecodeService::Behaviour fast;
  fast.ttft = std::chrono::milliseconds(2);
  fast.itl = std::chrono::milliseconds(1);
  decode_a_.SetBehaviour(fast);
  decode_b_.SetBehaviour(fast);
  decode_a_.SetLoad(Load(900, 0, 0.1f));
  backends_->PollOnce();
  Schedule schedule;
  for (int i = 0; i < 300; ++i) schedule.requests.push_back({0, 8, 20, {}, i});
  ReplayOptions o;
  o.target = router_address_;
  o.progress = false;
  o.concurrency = 64;
  auto records = Replayer(o).Run(schedule);
  ASSERT_TRUE(records.ok()) << records.status();
  for (const RequestRecord& r : *records) {
    ASSERT_EQ(r.status_code, 0) << r.request_id << ": " << r.status_message;
    ASSERT_EQ(r.output_tokens, 20) << r.request_id;
  }
  EXPECT_EQ(decode_a_.seen().size() + decode_b_.seen().size(), 300u);
  EXPECT_TRUE(WaitFor([&] { return service_->inflight() == 0; }));
}

TEST_F(RouterTest, MetricsEndpointPassesPromtool) {
  Generate(Request("r-14", 2));
  Generate(Request("", 2));
  auto server = metrics::MetricsHttpServer::Start("127.0.0.1:0", &registry_);
  ASSERT_TRUE(server.ok()) << server.status();
  auto body = metrics::testing::HttpGet((*server)->port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_THAT(*body, HasSubstr("fluxion_router_requests_total{code=\"OK\"} 1"));
  EXPECT_THAT(*body, HasSubstr("fluxion_router_requests_total{code=\"INVALID_ARGUMENT\"} 1"));
  EXPECT_THAT(*body, HasSubstr("fluxion_router_backends_healthy{role=\"decode\"} 2"));
  if (!metrics::testing::HavePromtool()) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  }
  absl::Status check = metrics::testing::PromtoolCheck(*body);
  EXPECT_TRUE(check.ok()) << check << "\n" << *body;
}

TEST(BackendsTest, DnsNamesResolveToEveryAddressAndAreHealthChecked) {
  auto resolved = ResolveAll("localhost", 7100);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_THAT(*resolved, ::testing::Contains("127.0.0.1:7100"));
  EXPECT_EQ(ResolveAll("no-such-host.invalid", 1).status().code(), absl::StatusCode::kUnavailable);

  FakeDecodeService decode;
  decode.SetLoad(Load(500, 0, 0.5f));
  FakeServer server(&decode, "fluxion.v1.DecodeService");
  Backends::Options o;
  o.decode_dns = {"localhost:" + std::to_string(server.port())};
  o.start_poller = false;
  auto backends = Backends::Create(o);
  ASSERT_TRUE(backends.ok()) << backends.status();
  auto nodes = (*backends)->Snapshot(Role::kDecode);
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].address, "127.0.0.1:" + std::to_string(server.port()));
  EXPECT_TRUE(nodes[0].healthy) << nodes[0].last_error;
  EXPECT_EQ(Backends::Create(Backends::Options{}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BackendsTest, ServerWithoutItsServiceNameIsUnhealthy) {
  // Health is asked for the role's service name only; "" SERVING does not stand in for it.
  FakeDecodeService decode;
  decode.SetLoad(Load(500, 0, 0.5f));
  FakeServer server(&decode, /*service_name=*/"");
  Backends::Options o;
  o.decode_addresses = {server.address()};
  o.start_poller = false;
  auto backends = Backends::Create(o);
  ASSERT_TRUE(backends.ok()) << backends.status();
  EXPECT_EQ((*backends)->HealthyCount(Role::kDecode), 0);
  EXPECT_THAT((*backends)->Snapshot(Role::kDecode)[0].last_error, HasSubstr("health check"));
}

TEST(BackendsTest, NotServingServiceNameMakesANodeUnhealthy) {
  FakeDecodeService decode;
  decode.SetLoad(Load(500, 0, 0.5f));
  FakeServer server(&decode, "fluxion.v1.DecodeService");
  Backends::Options o;
  o.decode_addresses = {server.address()};
  o.start_poller = false;
  auto backends = Backends::Create(o);
  ASSERT_TRUE(backends.ok()) << backends.status();
  EXPECT_EQ((*backends)->HealthyCount(Role::kDecode), 1);
  server.SetServing(false);  // NOT_SERVING for every name, the service's included
  (*backends)->PollOnce();
  EXPECT_EQ((*backends)->HealthyCount(Role::kDecode), 0);
  EXPECT_THAT((*backends)->Snapshot(Role::kDecode)[0].last_error, HasSubstr("NOT_SERVING"));
}

TEST(BackendsTest, MissedChecksDropANodeOnlyAfterNInARowAndItComesBackAfterM) {
  // A missed check (GetLoad not answered, as a node too busy to answer in time looks) used to
  // drop the node at once. Now it takes N = 3 misses in a row, and M = 2 passes in a row to take
  // it back; each state is in the router's metrics.
  FakeDecodeService decode;
  decode.SetLoad(Load(500, 0, 0.5f));
  FakeServer server(&decode, "fluxion.v1.DecodeService");
  metrics::Registry registry;
  Backends::Options o;
  o.decode_addresses = {server.address()};
  o.start_poller = false;
  o.registry = &registry;
  auto created = Backends::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  Backends& backends = **created;
  const std::string state_series = "fluxion_router_backend_state{address=\"" + server.address() +
                                   "\",role=\"decode\",state=\"";
  auto state_is = [&](const std::string& state) {
    return registry.Render().find(state_series + state + "\"} 1") != std::string::npos;
  };
  ASSERT_EQ(backends.HealthyCount(Role::kDecode), 1);
  EXPECT_TRUE(state_is("healthy")) << registry.Render();

  decode.SetLoadStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake: too busy"));
  backends.PollOnce();
  backends.PollOnce();
  EXPECT_EQ(backends.HealthyCount(Role::kDecode), 1) << "dropped before 3 misses in a row";
  EXPECT_TRUE(state_is("suspect")) << registry.Render();
  EXPECT_EQ(backends.Snapshot(Role::kDecode)[0].consecutive_failures, 2);
  backends.PollOnce();
  EXPECT_EQ(backends.HealthyCount(Role::kDecode), 0);
  EXPECT_TRUE(state_is("ejected")) << registry.Render();
  EXPECT_THAT(backends.Snapshot(Role::kDecode)[0].last_error, HasSubstr("fake: too busy"));

  decode.SetLoadStatus(grpc::Status::OK);
  backends.PollOnce();
  EXPECT_EQ(backends.HealthyCount(Role::kDecode), 0) << "taken back after 1 pass, want 2";
  EXPECT_TRUE(state_is("recovering")) << registry.Render();
  EXPECT_THAT(backends.Snapshot(Role::kDecode)[0].last_error, HasSubstr("1 of 2"));
  backends.PollOnce();
  EXPECT_EQ(backends.HealthyCount(Role::kDecode), 1);
  EXPECT_TRUE(state_is("healthy")) << registry.Render();
  EXPECT_EQ(registry
                .AddCounter("fluxion_router_backend_ejections_total", "",
                            {{"role", "decode"}, {"address", server.address()}})
                ->value(),
            1);
  if (metrics::testing::HavePromtool()) {
    absl::Status check = metrics::testing::PromtoolCheck(registry.Render());
    EXPECT_TRUE(check.ok()) << check << "\n" << registry.Render();
  }
}

TEST(BackendsTest, ADrainingNodeIsDroppedAtOnce) {
  // It said it takes no more work: no waiting for N checks.
  FakeDecodeService decode;
  v1::DecodeLoad load = Load(500, 0, 0.5f);
  decode.SetLoad(load);
  FakeServer server(&decode, "fluxion.v1.DecodeService");
  Backends::Options o;
  o.decode_addresses = {server.address()};
  o.start_poller = false;
  auto backends = Backends::Create(o);
  ASSERT_TRUE(backends.ok()) << backends.status();
  ASSERT_EQ((*backends)->HealthyCount(Role::kDecode), 1);
  load.set_draining(true);
  decode.SetLoad(load);
  (*backends)->PollOnce();
  EXPECT_EQ((*backends)->HealthyCount(Role::kDecode), 0);
  EXPECT_EQ((*backends)->Snapshot(Role::kDecode)[0].last_error, "draining");
}

TEST(BackendsTest, HysteresisCountsOutOfRangeAreRefused) {
  Backends::Options o;
  o.decode_addresses = {"127.0.0.1:1"};
  o.start_poller = false;
  o.health.failures_to_eject = 0;
  EXPECT_EQ(Backends::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::cluster
