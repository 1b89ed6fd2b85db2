// The VllmEngine service in front of the real RouterService on one gRPC server (the in-process
// hop of cluster/vllm_engine_service.h), with fake decode and prefill nodes behind it
// (cluster/fake_decode_service.h): deadlines, errors after the first token, Abort by id and
// client cancellation reach the nodes as the router's own clients' would.
#include "cluster/vllm_engine_service.h"

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cluster/backends.h"
#include "cluster/fake_decode_service.h"
#include "cluster/router_service.h"
#include "common/metrics.h"
#include "common/wait_testing.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

namespace ve = vllm::grpc::engine;
using testing::FakeDecodeService;
using testing::FakePrefillService;
using testing::FakeServer;
using SystemClock = std::chrono::system_clock;

struct Stream {
  grpc::Status status;
  std::vector<uint32_t> tokens;
  bool has_complete = false;
  ve::GenerateComplete complete;
};

class VllmEngineServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::DecodeLoad load;
    load.set_free_kv_pages(900);
    load.set_total_kv_pages(1000);
    load.set_page_tokens(16);
    load.set_admittable_prompt_tokens(1 << 20);
    load.mutable_server()->set_role(v1::SERVER_ROLE_DECODE);
    load.mutable_server()->set_max_context_tokens(4096);
    decode_.SetLoad(load);
    decode_server_ = std::make_unique<FakeServer>(&decode_, "fluxion.v1.DecodeService");
    prefill_server_ = std::make_unique<FakeServer>(&prefill_, "fluxion.v1.PrefillService");
    Backends::Options o;
    o.decode_addresses = {decode_server_->address()};
    o.prefill_addresses = {prefill_server_->address()};
    o.start_poller = false;
    auto backends = Backends::Create(o);
    ASSERT_TRUE(backends.ok()) << backends.status();
    backends_ = std::move(*backends);
    backends_->PollOnce();
    router_ = std::make_unique<RouterService>(backends_.get(), RouterOptions(), &registry_);
    VllmEngineOptions vo;
    vo.healthy = [this] { return backends_->HealthyCount(Role::kDecode) > 0; };
    vllm_ = std::make_unique<VllmEngineService>(std::move(vo));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(router_.get());
    builder.RegisterService(vllm_.get());
    server_ = builder.BuildAndStart();
    vllm_->Connect(server_->InProcessChannel(grpc::ChannelArguments()));
    stub_ = ve::VllmEngine::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                        grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    server_->Shutdown(SystemClock::now() + std::chrono::seconds(1));
    server_->Wait();
  }

  static ve::GenerateRequest Request(const std::string& id, uint32_t max_tokens) {
    ve::GenerateRequest r;
    r.set_request_id(id);
    r.mutable_tokenized()->add_input_ids(1);
    r.mutable_tokenized()->add_input_ids(2);
    r.mutable_sampling_params()->set_max_tokens(max_tokens);
    r.set_stream(true);
    return r;
  }

  // `after_first` runs once the first chunk arrived (with the call's context).
  Stream Generate(const ve::GenerateRequest& request, std::chrono::milliseconds deadline,
                  const std::function<void(grpc::ClientContext*)>& after_first = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(SystemClock::now() + deadline);
    auto reader = stub_->Generate(&context, request);
    Stream out;
    ve::GenerateResponse response;
    bool first = true;
    while (reader->Read(&response)) {
      if (response.has_chunk()) {
        for (uint32_t t : response.chunk().token_ids()) out.tokens.push_back(t);
        if (first && after_first) after_first(&context);
        first = false;
      } else if (response.has_complete()) {
        out.has_complete = true;
        out.complete = response.complete();
      }
    }
    out.status = reader->Finish();
    return out;
  }

  metrics::Registry registry_;
  FakeDecodeService decode_;
  FakePrefillService prefill_;
  std::unique_ptr<FakeServer> decode_server_, prefill_server_;
  std::unique_ptr<Backends> backends_;
  std::unique_ptr<RouterService> router_;
  std::unique_ptr<VllmEngineService> vllm_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ve::VllmEngine::Stub> stub_;
};

TEST_F(VllmEngineServiceTest, StreamsChunksAndCompleteWithTotals) {
  const Stream s = Generate(Request("v1", 5), std::chrono::seconds(10));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.tokens.size(), 5u);
  ASSERT_TRUE(s.has_complete);
  EXPECT_EQ(s.complete.completion_tokens(), 5u);
  EXPECT_EQ(s.complete.prompt_tokens(), 2u);
  // The server's side of the call ends just after the client's (OnDone): its entry for Abort
  // goes then.
  EXPECT_TRUE(WaitFor([&] { return vllm_->open_calls() == 0; })) << vllm_->open_calls();
}

TEST_F(VllmEngineServiceTest, ClientDeadlineReachesTheDecodeNode) {
  const auto before = SystemClock::now();
  ASSERT_TRUE(Generate(Request("v2", 2), std::chrono::seconds(7)).status.ok());
  ASSERT_EQ(decode_.seen().size(), 1u);
  // The router forwards the budget with its grace (500 ms) on top; without propagation the
  // decode node would see no deadline at all. The client's deadline lies in [before, received] +
  // 7 s, and each gRPC hop (client, service, router) re-anchors the remaining time on arrival,
  // rounded up to its encoding's unit (10 ms for 1-10 s), which can only move it later, by at
  // most the time the call took to arrive plus the roundings: bounds set by when things happened,
  // not by how fast the machine is.
  using std::chrono::milliseconds;
  const testing::SeenRequest seen = decode_.seen()[0];
  EXPECT_GE(seen.deadline, before + milliseconds(7500 - 1));
  EXPECT_LE(seen.deadline, seen.received + milliseconds(7500 + 3 * 11));
}

TEST_F(VllmEngineServiceTest, FailureAfterTheFirstTokenIsTheStatusWithNoComplete) {
  FakeDecodeService::Behaviour b;
  b.fail_after_tokens = 2;
  b.fail_code = grpc::StatusCode::DATA_LOSS;
  decode_.SetBehaviour(b);
  const Stream s = Generate(Request("v3", 6), std::chrono::seconds(10));
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(s.tokens.size(), 2u);
  EXPECT_FALSE(s.has_complete);  // vLLM's protocol has no in-stream error
}

TEST_F(VllmEngineServiceTest, AbortByIdEndsTheStreamWithAbort) {
  FakeDecodeService::Behaviour b;
  b.itl = std::chrono::milliseconds(50);
  decode_.SetBehaviour(b);
  const Stream s = Generate(Request("v4", 400), std::chrono::seconds(30), [this](auto*) {
    grpc::ClientContext c;
    ve::AbortRequest abort;
    abort.add_request_ids("v4");
    abort.add_request_ids("nobody");  // unknown ids are ignored
    ve::AbortResponse response;
    EXPECT_TRUE(stub_->Abort(&c, abort, &response).ok());
  });
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  ASSERT_TRUE(s.has_complete);
  EXPECT_EQ(s.complete.finish_reason(), "abort");
  EXPECT_LT(s.tokens.size(), 400u);
}

TEST_F(VllmEngineServiceTest, ClientCancelCancelsTheDecodeCall) {
  FakeDecodeService::Behaviour b;
  b.itl = std::chrono::milliseconds(50);
  decode_.SetBehaviour(b);
  const Stream s = Generate(Request("v5", 400), std::chrono::seconds(30),
                            [](grpc::ClientContext* c) { c->TryCancel(); });
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::CANCELLED);
  // The fake records the cancellation when its handler returns.
  WaitFor([&] { return decode_.seen().size() == 1 && decode_.seen()[0].cancelled; });
  ASSERT_EQ(decode_.seen().size(), 1u);
  EXPECT_TRUE(decode_.seen()[0].cancelled);
}

TEST_F(VllmEngineServiceTest, HealthAndLoads) {
  grpc::ClientContext c1;
  ve::HealthCheckResponse health;
  ASSERT_TRUE(stub_->HealthCheck(&c1, ve::HealthCheckRequest(), &health).ok());
  EXPECT_TRUE(health.healthy());
  grpc::ClientContext c2;
  ve::GetLoadsResponse loads;
  ASSERT_TRUE(stub_->GetLoads(&c2, ve::GetLoadsRequest(), &loads).ok());
  ASSERT_EQ(loads.loads_size(), 1);
  grpc::ClientContext c3;
  ve::GetLoadsRequest rank;
  rank.set_dp_rank(2);
  EXPECT_EQ(stub_->GetLoads(&c3, rank, &loads).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext c4;
  ve::GetModelInfoResponse info;
  ASSERT_TRUE(stub_->GetModelInfo(&c4, ve::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.max_context_length(), 4096u);
  grpc::ClientContext c5;
  ve::EmbedResponse embed;
  EXPECT_EQ(stub_->Embed(&c5, ve::EmbedRequest(), &embed).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

}  // namespace
}  // namespace fluxion::cluster
