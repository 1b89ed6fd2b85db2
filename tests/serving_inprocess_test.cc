// The real DecodeServiceImpl and PrefillServiceImpl in one process: real gRPC on loopback ports,
// the loopback transport instead of UCX (the prefill node's puts are memcpy into the decode
// node's arena), the trained tiny model. What a client may name and do: trusted prefill peers,
// abort tokens, duplicate ids, per-attempt prefill ids, the max_tokens bound, the prefill queue
// bound (docs/SECURITY.md).
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/server_main.h"
#include "common/wait_testing.h"
#include "decode/kv/kv_admission.h"
#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
#include "decode/serving/batch_scheduler.h"
#include "decode/serving/decode_service.h"
#include "decode/serving/prefill_peers.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "model/model.h"
#include "prefill/prefill_engine.h"
#include "prefill/prefill_service.h"
#include "proto/convert.h"
#include "transfer/loopback_transport.h"

namespace fluxion {
namespace {

namespace v1 = ::fluxion::v1;
using ::testing::HasSubstr;

constexpr int64_t kPageTokens = 16;

std::string ModelDir() {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(src ? src : ".") + "/models/fluxion-tiny-retrieval";
}

struct Loaded {
  std::unique_ptr<model::Model> model;
  v1::ModelLayout layout;
};

Loaded Load() {
  Loaded l;
  auto model = model::Model::Load(ModelDir());
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return l;
  auto hash = proto::ModelFingerprint(ModelDir());
  EXPECT_TRUE(hash.ok()) << hash.status();
  l.layout = proto::LayoutFor((*model)->config(), ModelDir(), hash.ok() ? *hash : "", kPageTokens);
  l.model = std::move(*model);
  return l;
}

v1::ServerInfo Info(v1::ServerRole role, const std::string& name, const Loaded& l) {
  v1::ServerInfo info;
  info.set_role(role);
  info.set_node_name(name);
  *info.mutable_layout() = l.layout;
  info.set_protocol_version(1);
  info.set_max_context_tokens(static_cast<uint32_t>(l.model->config().max_position_embeddings));
  return info;
}

// The secret every node of these tests shares (sealed prefill requests, proto/prefill_seal.h).
std::shared_ptr<const proto::TransferSecret> SharedSecret() {
  static const auto* const secret = new std::shared_ptr<const proto::TransferSecret>(
      std::make_shared<const proto::TransferSecret>(
          *proto::TransferSecret::FromBytes(std::string(32, 's'))));
  return *secret;
}

// A prefill node: the real engine and service; `layer_delay` keeps a request in it for a while.
class PrefillNode {
 public:
  PrefillNode(const std::string& name, absl::Duration layer_delay, int64_t max_queued,
              absl::Duration transfer_timeout = absl::Seconds(30)) {
    loaded_ = Load();
    transfer::LoopbackOptions o;
    o.node_name = name;
    o.compat = proto::CompatibilityOf(loaded_.layout, 1);
    transport_ = std::make_unique<transfer::LoopbackTransport>(o);
    prefill::PrefillEngineOptions eo;
    eo.layer_delay = layer_delay;
    eo.transfer_timeout = transfer_timeout;
    engine_ = std::make_unique<prefill::PrefillEngine>(loaded_.model.get(), transport_.get(),
                                                       loaded_.layout, eo);
    service_ = std::make_unique<prefill::PrefillServiceImpl>(
        engine_.get(), transport_.get(), Info(v1::SERVER_ROLE_PREFILL, name, loaded_),
        *SharedSecret());
    service_->SetMaxQueuedRequests(max_queued);
    int port = 0;
    auto server = serving::StartGrpcServer("127.0.0.1:0", service_.get(), &port);
    EXPECT_TRUE(server.ok()) << server.status();
    if (server.ok()) server_ = std::move(*server);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  ~PrefillNode() {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  const std::string& address() const { return address_; }
  prefill::PrefillServiceImpl& service() { return *service_; }

 private:
  Loaded loaded_;
  std::unique_ptr<transfer::LoopbackTransport> transport_;
  std::unique_ptr<prefill::PrefillEngine> engine_;
  std::unique_ptr<prefill::PrefillServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

// A decode node trusting `trusted` prefill nodes.
class DecodeNode {
 public:
  DecodeNode(const std::string& name, std::vector<std::string> trusted) {
    loaded_ = Load();
    const model::AttentionShape shape = loaded_.model->attention_shape();
    transfer::LoopbackOptions o;
    o.node_name = name;
    o.compat = proto::CompatibilityOf(loaded_.layout, 1);
    transport_ = std::make_unique<transfer::LoopbackTransport>(o);
    const decode::KvShape kv{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens};
    decode::KvArenaOptions ao;
    ao.huge_pages = false;
    auto arena = decode::KvArena::Create(kv.page_bytes(), 16384, ao);
    EXPECT_TRUE(arena.ok()) << arena.status();
    arena_ = std::move(*arena);
    auto registration = transport_->Register({arena_->base(), arena_->bytes()}, {true});
    EXPECT_TRUE(registration.ok()) << registration.status();
    registration_ = std::move(*registration);
    auto descriptor = registration_->Describe();
    EXPECT_TRUE(descriptor.ok()) << descriptor.status();
    const int64_t growth = shape.num_layers * shape.num_kv_heads;
    decode::KvAdmissionOptions ko;
    ko.headroom_pages = growth * 4;
    admission_ = std::make_unique<decode::KvAdmission>(arena_.get(), ko);
    scheduler_ = std::make_unique<decode::BatchScheduler>(loaded_.model.get(), admission_.get(),
                                                          growth, kPageTokens);
    decode::PrefillPeers::Options po;
    po.addresses = std::move(trusted);
    auto peers = decode::PrefillPeers::Create(po);
    EXPECT_TRUE(peers.ok()) << peers.status();
    decode::DecodeServiceOptions options;
    options.transfer_secret = SharedSecret();
    options.prefill_peers = std::move(*peers);
    options.default_policy = "full";
    options.page_tokens = kPageTokens;
    options.quarantine_lease = absl::Milliseconds(500);
    service_ = std::make_unique<decode::DecodeServiceImpl>(
        loaded_.model.get(), arena_.get(), admission_.get(), scheduler_.get(), transport_.get(),
        *descriptor, Info(v1::SERVER_ROLE_DECODE, name, loaded_), options);
    int port = 0;
    auto server = serving::StartGrpcServer("127.0.0.1:0", service_.get(), &port);
    EXPECT_TRUE(server.ok()) << server.status();
    if (server.ok()) server_ = std::move(*server);
    stub_ = v1::DecodeService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  ~DecodeNode() {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  v1::DecodeService::Stub& stub() { return *stub_; }
  decode::DecodeServiceImpl& service() { return *service_; }
  // Its memory's side of the loopback transport (pausing it: a host whose link is down).
  transfer::LoopbackTransport& transport() { return *transport_; }
  int64_t context_tokens() const { return loaded_.model->config().max_position_embeddings; }

 private:
  Loaded loaded_;
  std::unique_ptr<transfer::LoopbackTransport> transport_;
  std::unique_ptr<decode::KvArena> arena_;
  std::unique_ptr<transfer::Registration> registration_;
  std::unique_ptr<decode::KvAdmission> admission_;
  std::unique_ptr<decode::BatchScheduler> scheduler_;
  std::unique_ptr<decode::DecodeServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::DecodeService::Stub> stub_;
};

v1::GenerateRequest Request(const std::string& id, uint32_t max_tokens, int prompt = 20) {
  v1::GenerateRequest r;
  r.set_request_id(id);
  for (int i = 0; i < prompt; ++i) r.add_prompt_token_ids(static_cast<uint32_t>(65 + i % 26));
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_temperature(0);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

// One Generate call read to its end.
struct Outcome {
  grpc::Status status;
  uint32_t tokens = 0;
  v1::GenerateResponse last;
};

Outcome Drain(grpc::ClientReader<v1::GenerateResponse>& reader) {
  Outcome o;
  v1::GenerateResponse m;
  while (reader.Read(&m)) {
    o.tokens += m.chunk().token_ids_size();
    o.last = m;
  }
  o.status = reader.Finish();
  return o;
}

Outcome Generate(v1::DecodeService::Stub& stub, const v1::GenerateRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub.Generate(&context, request);
  return Drain(*reader);
}

// A Generate call kept open, with its abort token.
struct OpenCall {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
  std::string token;
};

std::unique_ptr<OpenCall> Open(v1::DecodeService::Stub& stub, const v1::GenerateRequest& request) {
  auto call = std::make_unique<OpenCall>();
  call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  call->reader = stub.Generate(&call->context, request);
  call->reader->WaitForInitialMetadata();
  const auto& md = call->context.GetServerInitialMetadata();
  auto it = md.find(decode::DecodeServiceImpl::kAbortTokenKey);
  if (it != md.end()) call->token = std::string(it->second.data(), it->second.size());
  return call;
}

v1::AbortResponse Abort(v1::DecodeService::Stub& stub, const std::string& id,
                        const std::string& token) {
  grpc::ClientContext context;
  v1::AbortRequest a;
  a.add_request_ids(id);
  if (!token.empty()) a.add_abort_tokens(token);
  a.set_reason("test abort");
  v1::AbortResponse response;
  EXPECT_TRUE(stub.Abort(&context, a, &response).ok());
  return response;
}

class ServingInProcessTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { kernels::cpu::SetNumThreads(1); }
};

TEST_F(ServingInProcessTest, UntrustedPrefillAddressIsRefusedBeforeAnyDial) {
  PrefillNode prefill("prefill-a", absl::ZeroDuration(), 64);
  DecodeNode decode("decode-a", {prefill.address()});
  // A host the client picked: the decode node must not send it its worker address and key.
  v1::GenerateRequest request = Request("r-1", 2);
  request.set_prefill_address("127.0.0.1:1");
  Outcome refused = Generate(decode.stub(), request);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << refused.status.error_message();
  EXPECT_THAT(refused.status.error_message(), HasSubstr("--prefill-address"));
  EXPECT_EQ(decode.service().metrics().rejected, 1u);

  // The trusted node, named or by default, serves.
  request.set_prefill_address(prefill.address());
  Outcome named = Generate(decode.stub(), request);
  ASSERT_TRUE(named.status.ok()) << named.status.error_message();
  EXPECT_EQ(named.tokens, 2u);
  Outcome by_default = Generate(decode.stub(), Request("r-2", 2));
  ASSERT_TRUE(by_default.status.ok()) << by_default.status.error_message();
  EXPECT_EQ(prefill.service().metrics().requests_ok, 2u);
}

TEST_F(ServingInProcessTest, AbortNeedsTheTokenAndDuplicateIdsAreIndependent) {
  // A slow prefill node (6 layers x 200 ms each) keeps both requests in prefill while the test
  // aborts: the token comes at acceptance, before any wait, so a queued or prefilling request
  // can be aborted.
  PrefillNode prefill("prefill-b", absl::Milliseconds(200), 64);
  DecodeNode decode("decode-b", {prefill.address()});
  // Two callers pick the same id: both are accepted (ALREADY_EXISTS would tell the second one
  // that the first exists).
  auto first = Open(decode.stub(), Request("same", 3));
  auto second = Open(decode.stub(), Request("same", 3));
  ASSERT_EQ(first->token.size(), 32u);  // 128 random bits, hex
  ASSERT_EQ(second->token.size(), 32u);
  EXPECT_NE(first->token, second->token);
  EXPECT_EQ(decode.service().live_requests(), 2);

  // Without the token, with a wrong one, for an unknown id: the same empty answer.
  EXPECT_EQ(Abort(decode.stub(), "same", "").aborted_request_ids_size(), 0);
  EXPECT_EQ(Abort(decode.stub(), "same", std::string(32, 'a')).aborted_request_ids_size(), 0);
  EXPECT_EQ(Abort(decode.stub(), "other", first->token).aborted_request_ids_size(), 0);

  // The first caller's token aborts its own call only.
  v1::AbortResponse aborted = Abort(decode.stub(), "same", first->token);
  ASSERT_EQ(aborted.aborted_request_ids_size(), 1);
  EXPECT_EQ(aborted.aborted_request_ids(0), "same");
  Outcome one = Drain(*first->reader);
  ASSERT_TRUE(one.status.ok()) << one.status.error_message();
  ASSERT_TRUE(one.last.has_complete());
  EXPECT_EQ(one.last.complete().finish_reason(), v1::FINISH_REASON_ABORT);
  EXPECT_EQ(one.last.complete().abort_reason(), "test abort");
  Outcome two = Drain(*second->reader);
  ASSERT_TRUE(two.status.ok()) << two.status.error_message();
  ASSERT_TRUE(two.last.has_complete());
  EXPECT_EQ(two.last.complete().finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(two.tokens, 3u);
  EXPECT_TRUE(WaitFor([&] { return decode.service().live_requests() == 0; }));
  EXPECT_EQ(Abort(decode.stub(), "same", second->token).aborted_request_ids_size(), 0);
}

TEST_F(ServingInProcessTest, RetryOfAnIdThePrefillNodeStillHoldsIsNotRefused) {
  // A router retries request "r" on decode node B while the prefill node still computes it for
  // decode node A (in production: A died mid-prefill). The prefill node must see two ids.
  PrefillNode prefill("prefill-c", absl::Milliseconds(150), 64);
  DecodeNode a("decode-c1", {prefill.address()});
  DecodeNode b("decode-c2", {prefill.address()});
  Outcome on_a;
  std::thread first([&] { on_a = Generate(a.stub(), Request("r", 2)); });
  ASSERT_TRUE(WaitFor([&] { return prefill.service().Load().running_requests() == 1; }));
  Outcome on_b = Generate(b.stub(), Request("r", 2));
  first.join();
  EXPECT_TRUE(on_b.status.ok()) << on_b.status.error_message();
  EXPECT_EQ(on_b.tokens, 2u);
  EXPECT_TRUE(on_a.status.ok()) << on_a.status.error_message();

  // The same decode node, the same id twice at once (two callers): two Prefill ids as well.
  Outcome again;
  std::thread third([&] { again = Generate(a.stub(), Request("r", 2)); });
  ASSERT_TRUE(WaitFor([&] { return prefill.service().Load().running_requests() == 1; }));
  Outcome fourth = Generate(a.stub(), Request("r", 2));
  third.join();
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_TRUE(fourth.status.ok()) << fourth.status.error_message();
  EXPECT_EQ(prefill.service().metrics().requests_ok, 4u);
}

TEST_F(ServingInProcessTest, MaxTokensBeyondTheContextIsRefusedGivingTheBound) {
  PrefillNode prefill("prefill-d", absl::ZeroDuration(), 64);
  DecodeNode decode("decode-d", {prefill.address()});
  const int64_t room = decode.context_tokens() - 20;  // the prompt has 20 tokens
  for (uint32_t max_tokens : {4294967295u, 100000u, static_cast<uint32_t>(room + 1)}) {
    Outcome r = Generate(decode.stub(), Request("r-max", max_tokens));
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << max_tokens;
    EXPECT_THAT(r.status.error_message(), HasSubstr("sampling.max_tokens"));
    EXPECT_THAT(r.status.error_message(), HasSubstr(absl::StrCat("at most ", room)));
  }
  EXPECT_EQ(prefill.service().metrics().requests_ok, 0u);  // refused before any prefill
  Outcome fine = Generate(decode.stub(), Request("r-ok", 3));
  EXPECT_TRUE(fine.status.ok()) << fine.status.error_message();
}

TEST_F(ServingInProcessTest, FullPrefillQueueIsRefusedNamingTheFlag) {
  // One computing, one queued, the third is refused; the decode node frees its pages and relays
  // RESOURCE_EXHAUSTED (which a router retries on another pair). 6 layers x 400 ms: the first
  // computes for at least 2.4 s, while the test sees the second queue and sends the third.
  PrefillNode prefill("prefill-e", absl::Milliseconds(400), /*max_queued=*/1);
  DecodeNode decode("decode-e", {prefill.address()});
  Outcome running, queued;
  std::thread t1([&] { running = Generate(decode.stub(), Request("q-1", 2)); });
  ASSERT_TRUE(WaitFor([&] { return prefill.service().Load().running_requests() == 1; }));
  std::thread t2([&] { queued = Generate(decode.stub(), Request("q-2", 2)); });
  ASSERT_TRUE(WaitFor([&] { return prefill.service().Load().queued_requests() == 1; }));
  Outcome refused = Generate(decode.stub(), Request("q-3", 2));
  t1.join();
  t2.join();
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.status.error_message();
  EXPECT_THAT(refused.status.error_message(), HasSubstr("--max-queued-requests 1"));
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_TRUE(queued.status.ok()) << queued.status.error_message();
  EXPECT_TRUE(WaitFor([&] { return decode.service().metrics().pages.free ==
                                      decode.service().metrics().pages.total; }));
}

TEST_F(ServingInProcessTest, AnUnreachableDecodeNodeHoldsOnlyItsOwnPrefillsNotTheNode) {
  // Decode node A stops taking writes (its transport's progress paused: the prefill node's puts
  // queue and never land, as behind a link that is down). Its request holds the prefill node only
  // for its own writes: a request of decode node B, sent while A's writes hang, completes while
  // they still hang (A's lease is 120 s). Before the compute slot was released at the end of the
  // forward, B waited behind A until the lease ran out (docs/FAULTS.md, "Findings").
  PrefillNode prefill("prefill-h", absl::ZeroDuration(), /*max_queued=*/8,
                      /*transfer_timeout=*/absl::Seconds(120));
  DecodeNode a("decode-ha", {prefill.address()}), b("decode-hb", {prefill.address()});
  a.transport().SetProgressPausedForTesting(true);
  Outcome stuck;
  std::thread t([&] { stuck = Generate(a.stub(), Request("h-a", 2)); });
  // A's compute is over and its writes are in flight (the call is still open at the node).
  ASSERT_TRUE(WaitFor([&] {
    return prefill.service().Load().running_requests() == 1 &&
           prefill.service().metrics().transport.batches_submitted > 0;
  }));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = b.stub().Generate(&context, Request("h-b", 2));
  Outcome healthy = Drain(*reader);
  EXPECT_TRUE(healthy.status.ok()) << healthy.status.error_message();
  EXPECT_EQ(healthy.tokens, 2u);
  // The order is the proof: B finished while A's request still waits for its own writes (they
  // cannot land while A's progress is paused), and A's finishes once they do.
  EXPECT_EQ(prefill.service().Load().running_requests(), 1u);
  a.transport().SetProgressPausedForTesting(false);
  t.join();
  EXPECT_TRUE(stuck.status.ok()) << stuck.status.error_message();
  EXPECT_EQ(stuck.tokens, 2u);
  EXPECT_EQ(prefill.service().metrics().requests_ok, 2u);
}

TEST(PrefillPeersTest, OnlyConfiguredAddressesAndTheAddressesOfConfiguredNamesAreTrusted) {
  decode::PrefillPeers::Options o;
  o.addresses = {"10.0.0.7:7001", "10.0.0.8:7001"};
  o.dns = {"localhost:7101"};
  auto peers = decode::PrefillPeers::Create(o);
  ASSERT_TRUE(peers.ok()) << peers.status();
  EXPECT_TRUE((*peers)->Check("10.0.0.7:7001").ok());
  EXPECT_TRUE((*peers)->Check("127.0.0.1:7101").ok());  // an A record of localhost
  const absl::Status other_port = (*peers)->Check("127.0.0.1:7102");
  EXPECT_EQ(other_port.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(other_port.message(), HasSubstr("--prefill-dns"));
  EXPECT_EQ((*peers)->Check("10.0.0.7:7001 ").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_LT((*peers)->Check(std::string(100000, 'x')).message().size(), 1000u);  // capped echo
  // Requests naming none take the addresses in turn.
  EXPECT_EQ(*(*peers)->Pick(), "10.0.0.7:7001");
  EXPECT_EQ(*(*peers)->Pick(), "10.0.0.8:7001");
  EXPECT_EQ(*(*peers)->Pick(), "10.0.0.7:7001");

  o.addresses = {"no-port"};
  EXPECT_THAT(decode::PrefillPeers::Create(o).status().message(), HasSubstr("--prefill-address"));
  o.addresses = {};
  o.dns = {"localhost:0"};
  EXPECT_THAT(decode::PrefillPeers::Create(o).status().message(), HasSubstr("--prefill-dns"));
  auto none = decode::PrefillPeers::Create(decode::PrefillPeers::Options{});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ((*none)->Pick().status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace fluxion
