// Tests of the fluxion.v1 wire contract: the generated code links and serves over a real
// in-process gRPC server (with the standard health service beside it), the stream termination rules
// of docs/PROTOCOL.md can be expressed with it, and the messages that carry KV targets survive
// serialisation within gRPC's default message limit.
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fluxion/v1/common.pb.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "gmock/gmock.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"

namespace fluxion::v1 {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::testing::ElementsAre;

// Bound on every RPC and every wait in this file: generous for a loaded 2-core CI machine, short
// enough that a hang fails the test instead of the CI job.
constexpr std::chrono::seconds kRpcTimeout(10);

std::chrono::system_clock::time_point RpcDeadline() {
  return std::chrono::system_clock::now() + kRpcTimeout;
}

// gRPC's default maximum receive message size (4 MiB): the reason bulk data goes over UCX.
constexpr size_t kDefaultGrpcMessageLimitBytes = 4 * 1024 * 1024;

// Writes a fixed sequence of responses, then finishes with a fixed status. Each write starts only
// when the previous one is done, as the callback API requires; nothing here blocks.
class ScriptedStream final : public grpc::ServerWriteReactor<GenerateResponse> {
 public:
  ScriptedStream(std::vector<GenerateResponse> responses, grpc::Status final_status)
      : responses_(std::move(responses)), final_status_(std::move(final_status)) {
    WriteNextOrFinish();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {  // The client went away: stop writing, but the reactor must still Finish.
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled"));
      return;
    }
    WriteNextOrFinish();
  }

  // Nothing to release: a cancelled stream fails its pending write, and OnWriteDone finishes.
  void OnCancel() override {}

  void OnDone() override { delete this; }

 private:
  void WriteNextOrFinish() {
    if (next_ == responses_.size()) {
      Finish(final_status_);
      return;
    }
    StartWrite(&responses_[next_++]);
  }

  std::vector<GenerateResponse> responses_;
  size_t next_ = 0;
  const grpc::Status final_status_;
};

// A stand-in decode node, only as smart as the tests need:
// - an empty request_id is rejected before any output (INVALID_ARGUMENT, no messages);
// - otherwise it streams max_tokens tokens (ids 1000, 1001, ...) in chunks of two, then
//   `complete` with FINISH_REASON_LENGTH;
// - with timeout_ms == 0 it streams one chunk, then fails with DEADLINE_EXCEEDED both in-stream
//   (`error`) and as the final status.
class FakeDecodeService final : public DecodeService::CallbackService {
 public:
  grpc::ServerWriteReactor<GenerateResponse>* Generate(grpc::CallbackServerContext* context,
                                                       const GenerateRequest* request) override {
    if (request->request_id().empty()) {
      return new ScriptedStream(
          {}, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "request_id is empty"));
    }
    const uint32_t prompt_tokens = request->prompt_token_ids_size();
    const uint32_t max_tokens = request->sampling().max_tokens();
    const bool fail_after_first_chunk = request->has_timeout_ms() && request->timeout_ms() == 0;

    std::vector<GenerateResponse> responses;
    uint32_t sent = 0;
    while (sent < max_tokens) {
      GenerateChunk* chunk = responses.emplace_back().mutable_chunk();
      for (int i = 0; i < 2 && sent < max_tokens; ++i) chunk->add_token_ids(1000 + sent++);
      chunk->set_completion_tokens(sent);
      if (fail_after_first_chunk) break;
    }
    if (fail_after_first_chunk) {
      GenerateError* error = responses.emplace_back().mutable_error();
      error->set_code(grpc::StatusCode::DEADLINE_EXCEEDED);
      error->set_message("timeout_ms ran out");
      error->mutable_usage()->set_prompt_tokens(prompt_tokens);
      error->mutable_usage()->set_completion_tokens(sent);
      return new ScriptedStream(
          std::move(responses),
          grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "timeout_ms ran out"));
    }
    GenerateComplete* complete = responses.emplace_back().mutable_complete();
    complete->set_finish_reason(FINISH_REASON_LENGTH);
    complete->mutable_usage()->set_prompt_tokens(prompt_tokens);
    complete->mutable_usage()->set_completion_tokens(sent);
    complete->set_sparse_policy("full");
    complete->set_read_fraction(1.0f);
    return new ScriptedStream(std::move(responses), grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* context,
                                    const GetLoadRequest* request, DecodeLoad* load) override {
    load->set_running_requests(1);
    load->set_free_kv_pages(768);
    load->set_total_kv_pages(1024);
    load->set_page_tokens(16);
    load->set_kv_usage(0.25f);
    load->mutable_server()->set_role(SERVER_ROLE_DECODE);
    load->mutable_server()->set_protocol_version(PROTOCOL_VERSION_1);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

// Serving statuses of grpc.health.v1.HealthCheckResponse.
constexpr uint32_t kHealthServing = 1;
constexpr uint32_t kHealthNotServing = 2;

// Calls grpc.health.v1.Health/Check for `service` ("" = the whole server) and stores the serving
// status in `*serving_status`. The two messages are encoded by hand (HealthCheckRequest is
// `string service = 1`, HealthCheckResponse is `ServingStatus status = 1`): the health service is
// built into libgrpc++, and copying health.proto in would define grpc.health.v1 a second time.
grpc::Status CheckHealth(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                         uint32_t* serving_status) {
  // Shared with the completion callback, which may run after this function has given up waiting.
  struct Call {
    grpc::ClientContext context;
    grpc::ByteBuffer request;
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
  };
  auto call = std::make_shared<Call>();
  std::string request_bytes;
  if (!service.empty()) {
    // One-byte length: service names in these tests are short.
    if (service.size() >= 128) return grpc::Status(grpc::StatusCode::INTERNAL, "name too long");
    request_bytes.push_back(0x0a);  // field 1, length-delimited
    request_bytes.push_back(static_cast<char>(service.size()));
    request_bytes += service;
  }
  grpc::Slice slice(request_bytes);
  call->request = grpc::ByteBuffer(&slice, 1);
  call->context.set_deadline(RpcDeadline());
  std::future<grpc::Status> done = call->done.get_future();

  grpc::GenericStub stub(channel);
  stub.UnaryCall(&call->context, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &call->request, &call->response,
                 [call](grpc::Status status) { call->done.set_value(std::move(status)); });
  // The context deadline already bounds the call; this bounds our wait should gRPC misbehave.
  if (done.wait_for(kRpcTimeout * 2) != std::future_status::ready) {
    call->context.TryCancel();
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "health check never completed");
  }
  grpc::Status status = done.get();
  if (!status.ok()) return status;

  grpc::Slice reply;
  if (!call->response.DumpToSingleSlice(&reply).ok()) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "unreadable health reply");
  }
  google::protobuf::io::CodedInputStream in(reply.begin(), static_cast<int>(reply.size()));
  *serving_status = 0;  // UNKNOWN, which is also what an empty (all-default) reply means.
  constexpr uint32_t kStatusFieldTag = (1 << 3) | 0;  // field 1, varint
  while (const uint32_t tag = in.ReadTag()) {
    if (tag != kStatusFieldTag || !in.ReadVarint32(serving_status)) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "unexpected health reply");
    }
  }
  return grpc::Status::OK;
}

class DecodeProtoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Every Fluxion server does this; it must happen before the server is built.
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                   grpc::InsecureChannelCredentials());
    stub_ = DecodeService::NewStub(channel_);
  }

  void TearDown() override {
    // Calls still running at the deadline are cancelled, so this cannot hang.
    if (server_ != nullptr) server_->Shutdown(RpcDeadline());
  }

  // Runs Generate to the end; returns every message received and the final status.
  grpc::Status RunGenerate(const GenerateRequest& request,
                           std::vector<GenerateResponse>* responses) {
    grpc::ClientContext context;
    context.set_deadline(RpcDeadline());
    std::unique_ptr<grpc::ClientReader<GenerateResponse>> reader =
        stub_->Generate(&context, request);
    GenerateResponse response;
    while (reader->Read(&response)) responses->push_back(response);
    return reader->Finish();
  }

  static GenerateRequest MakeRequest(uint32_t max_tokens) {
    GenerateRequest request;
    request.set_request_id("req-1");
    for (uint32_t token : {128000u, 9906u, 1917u}) request.add_prompt_token_ids(token);
    request.mutable_sampling()->set_temperature(0.0f);
    request.mutable_sampling()->set_max_tokens(max_tokens);
    request.set_protocol_version(PROTOCOL_VERSION_1);
    return request;
  }

  FakeDecodeService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<DecodeService::Stub> stub_;
};

TEST_F(DecodeProtoTest, StreamEndsWithCompleteAfterChunks) {
  std::vector<GenerateResponse> responses;
  const grpc::Status status = RunGenerate(MakeRequest(/*max_tokens=*/5), &responses);

  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(responses.size(), 4u);
  std::vector<uint32_t> tokens;
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(responses[i].kind_case(), GenerateResponse::kChunk) << "message " << i;
    tokens.insert(tokens.end(), responses[i].chunk().token_ids().begin(),
                  responses[i].chunk().token_ids().end());
    EXPECT_EQ(responses[i].chunk().completion_tokens(), tokens.size());
  }
  EXPECT_THAT(tokens, ElementsAre(1000, 1001, 1002, 1003, 1004));
  ASSERT_EQ(responses[3].kind_case(), GenerateResponse::kComplete);
  const GenerateComplete& complete = responses[3].complete();
  EXPECT_EQ(complete.finish_reason(), FINISH_REASON_LENGTH);
  EXPECT_FALSE(complete.has_matched_stop_token_id());
  EXPECT_EQ(complete.usage().prompt_tokens(), 3u);
  EXPECT_EQ(complete.usage().completion_tokens(), 5u);
}

TEST_F(DecodeProtoTest, FailureAfterOutputEndsWithErrorMessageAndTheSameStatusCode) {
  GenerateRequest request = MakeRequest(/*max_tokens=*/5);
  request.set_timeout_ms(0);
  std::vector<GenerateResponse> responses;
  const grpc::Status status = RunGenerate(request, &responses);

  // Messages written before a non-OK Finish still reach the client, in order, before the status.
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_EQ(responses.size(), 2u);
  EXPECT_EQ(responses[0].kind_case(), GenerateResponse::kChunk);
  ASSERT_EQ(responses[1].kind_case(), GenerateResponse::kError);
  EXPECT_EQ(responses[1].error().code(), static_cast<int32_t>(status.error_code()));
  EXPECT_EQ(responses[1].error().usage().completion_tokens(), 2u);
}

TEST_F(DecodeProtoTest, RejectionBeforeOutputIsAPlainStatusWithNoMessages) {
  GenerateRequest request = MakeRequest(/*max_tokens=*/5);
  request.clear_request_id();
  std::vector<GenerateResponse> responses;
  const grpc::Status status = RunGenerate(request, &responses);

  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(responses.empty());
}

TEST_F(DecodeProtoTest, GetLoadReturnsLoadWithServerInfo) {
  grpc::ClientContext context;
  context.set_deadline(RpcDeadline());
  DecodeLoad load;
  const grpc::Status status = stub_->GetLoad(&context, GetLoadRequest(), &load);

  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(load.free_kv_pages(), 768u);
  EXPECT_EQ(load.total_kv_pages(), 1024u);
  EXPECT_EQ(load.server().role(), SERVER_ROLE_DECODE);
  EXPECT_EQ(load.server().protocol_version(), static_cast<uint32_t>(PROTOCOL_VERSION_1));
}

TEST_F(DecodeProtoTest, UnimplementedRpcAnswersUnimplemented) {
  // The fake leaves Abort to the generated base class: a server that lacks an RPC of the contract
  // answers UNIMPLEMENTED rather than hanging, so clients can tell "old server" from "down".
  grpc::ClientContext context;
  context.set_deadline(RpcDeadline());
  AbortRequest request;
  request.add_request_ids("req-1");
  AbortResponse response;
  EXPECT_EQ(stub_->Abort(&context, request, &response).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(DecodeProtoTest, DefaultHealthServiceReportsServing) {
  uint32_t serving_status = 0;
  const grpc::Status status = CheckHealth(channel_, "", &serving_status);

  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(serving_status, kHealthServing);
}

TEST_F(DecodeProtoTest, HealthServiceReportsNotServingWhileDraining) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  ASSERT_NE(health, nullptr);
  health->SetServingStatus("fluxion.v1.DecodeService", true);
  uint32_t serving_status = 0;
  ASSERT_TRUE(CheckHealth(channel_, "fluxion.v1.DecodeService", &serving_status).ok());
  EXPECT_EQ(serving_status, kHealthServing);

  // What a draining server does (common/server_main.h, DrainPlan): its service name goes
  // NOT_SERVING (readiness), the whole server ("", liveness) stays SERVING.
  health->SetServingStatus("fluxion.v1.DecodeService", false);
  ASSERT_TRUE(CheckHealth(channel_, "", &serving_status).ok());
  EXPECT_EQ(serving_status, kHealthServing);
  ASSERT_TRUE(CheckHealth(channel_, "fluxion.v1.DecodeService", &serving_status).ok());
  EXPECT_EQ(serving_status, kHealthNotServing);
}

TEST_F(DecodeProtoTest, HealthServiceAnswersNotFoundForUnknownService) {
  uint32_t serving_status = 0;
  EXPECT_EQ(CheckHealth(channel_, "no.such.Service", &serving_status).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

// A PrefillRequest as a decode node would send it for a 128K-token prompt on Llama-3.1-8B
// (32 layers, 8 KV heads, 16-token pages: 2M pages in a few extents).
PrefillRequest MakeLongPrefillRequest() {
  constexpr uint32_t kPromptTokens = 131072;
  constexpr uint32_t kPageTokens = 16;
  constexpr uint32_t kLayers = 32;
  constexpr uint32_t kKvHeads = 8;
  constexpr uint32_t kPagesPerHead = kPromptTokens / kPageTokens;

  PrefillRequest request;
  request.set_request_id("req-128k");
  for (uint32_t i = 0; i < kPromptTokens; ++i) {
    request.add_prompt_token_ids(128255 - i % 1000);  // Large ids: the worst case varint size.
  }
  request.mutable_sampling()->set_temperature(0.7f);
  request.mutable_sampling()->set_seed(42);

  KvTarget* kv = request.mutable_kv_target();
  kv->set_transport("ucx");
  kv->set_peer_name("decode-0/1700000000");
  kv->set_worker_address(std::string("\x00\x01\xffucx-worker\x00", 15));  // Binary, with NULs.
  kv->set_remote_key(std::string(96, '\x5a'));
  kv->set_arena_base_address(0x7f0000000000ull);
  kv->set_page_bytes(8192);
  // Three runs that together hold every page of the request.
  const uint64_t total_pages = uint64_t{kLayers} * kKvHeads * kPagesPerHead;
  PageExtent* first = kv->add_extents();
  first->set_first_page_id(0);
  first->set_count(1000000);
  PageExtent* second = kv->add_extents();
  second->set_first_page_id(3000000);
  second->set_count(1000000);
  PageExtent* third = kv->add_extents();
  third->set_first_page_id(5000000);
  third->set_count(static_cast<uint32_t>(total_pages - 2000000));
  kv->set_page_order(PAGE_ORDER_LAYER_HEAD_PAGE);
  kv->set_pages_per_head(kPagesPerHead);
  kv->set_checksum_algorithm(CHECKSUM_ALGORITHM_CRC32C);

  SparseStateTarget* sparse = request.mutable_sparse_target();
  sparse->set_format_version(1);
  sparse->set_base_address(0x7f0000000000ull);
  ByteExtent* room = sparse->add_extents();
  room->set_offset(uint64_t{9000000} * 8192);
  room->set_length(uint64_t{32} << 20);
  sparse->set_observation_window_tokens(32);
  sparse->set_score_block_tokens(16);

  ModelLayout* layout = request.mutable_layout();
  layout->set_model_id("meta-llama/Llama-3.1-8B-Instruct");
  layout->set_model_hash("0123456789abcdef");
  layout->set_kv_dtype(DTYPE_BF16);
  layout->set_num_layers(kLayers);
  layout->set_num_kv_heads(kKvHeads);
  layout->set_head_dim(128);
  layout->set_page_tokens(kPageTokens);
  layout->set_layout_version(1);
  layout->set_sparse_state_format_version(1);
  request.set_protocol_version(PROTOCOL_VERSION_1);
  return request;
}

TEST(PrefillProtoTest, RequestWithKvTargetSurvivesSerialisationRoundTrip) {
  const PrefillRequest original = MakeLongPrefillRequest();
  std::string wire;
  ASSERT_TRUE(original.SerializeToString(&wire));

  PrefillRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_TRUE(MessageDifferencer::Equals(parsed, original));
  EXPECT_EQ(parsed.kv_target().worker_address().size(), 15u);
  ASSERT_EQ(parsed.kv_target().extents_size(), 3);
  uint64_t pages = 0;
  for (const PageExtent& extent : parsed.kv_target().extents()) pages += extent.count();
  EXPECT_EQ(pages, uint64_t{parsed.layout().num_layers()} * parsed.layout().num_kv_heads() *
                       parsed.kv_target().pages_per_head());
}

TEST(PrefillProtoTest, LongPromptRequestFitsGrpcDefaultMessageLimit) {
  // 128K prompt tokens at 3 bytes each plus a few extents: well under 4 MiB, because pages travel
  // as extents, never as a list of 2M page ids.
  EXPECT_LT(MakeLongPrefillRequest().ByteSizeLong(), kDefaultGrpcMessageLimitBytes / 8);
}

TEST(PrefillProtoTest, ResponseKeepsOneChecksumPerLayer) {
  PrefillResponse response;
  response.set_first_token_id(791);
  response.set_checksum_algorithm(CHECKSUM_ALGORITHM_XXH3_64);
  for (uint64_t layer = 0; layer < 32; ++layer) {
    response.add_layer_checksums(0xfedcba9876543210ull ^ layer);
  }
  response.mutable_sparse_state()->set_bytes_written(1 << 20);
  response.mutable_sparse_state()->set_num_retrieval_heads(40);
  response.mutable_sparse_state()->set_num_streaming_heads(216);

  PrefillResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(response.SerializeAsString()));
  ASSERT_EQ(parsed.layer_checksums_size(), 32);
  EXPECT_EQ(parsed.layer_checksums(31), 0xfedcba9876543210ull ^ 31);
  EXPECT_EQ(parsed.checksum_algorithm(), CHECKSUM_ALGORITHM_XXH3_64);
  EXPECT_EQ(
      parsed.sparse_state().num_retrieval_heads() + parsed.sparse_state().num_streaming_heads(),
      256u);
}

TEST(SamplingParamsProtoTest, ExplicitZeroIsDistinctFromAbsentAfterRoundTrip) {
  // temperature 0 means greedy while absent means 1.0: presence must survive the wire.
  SamplingParams greedy;
  greedy.set_temperature(0.0f);
  SamplingParams parsed_greedy;
  ASSERT_TRUE(parsed_greedy.ParseFromString(greedy.SerializeAsString()));
  EXPECT_TRUE(parsed_greedy.has_temperature());
  EXPECT_EQ(parsed_greedy.temperature(), 0.0f);

  SamplingParams defaults;
  SamplingParams parsed_defaults;
  ASSERT_TRUE(parsed_defaults.ParseFromString(defaults.SerializeAsString()));
  EXPECT_FALSE(parsed_defaults.has_temperature());
  EXPECT_FALSE(parsed_defaults.has_max_tokens());
  EXPECT_FALSE(parsed_defaults.has_seed());
}

}  // namespace
}  // namespace fluxion::v1
