// How each ending of a Prefill call treats the request's pages (docs/SERVING.md, "How a Prefill
// call ends and what happens to its pages"): in process, a decode service over the loopback
// transport and a random tiny model, against a fake prefill node (gRPC on localhost) that can
// answer Abort, ignore it, or answer with an error. Leases run on a fake clock.
#include "decode/serving/decode_service.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <set>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "common/metrics_names.h"
#include "common/wait_testing.h"
#include "decode/serving/prefill_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "proto/convert.h"
#include "transfer/loopback_transport.h"

namespace fluxion::decode {
namespace {

namespace v1 = ::fluxion::v1;
namespace names = ::fluxion::metrics::names;
using ::testing::HasSubstr;

// A prefill node that writes nothing and ends each call as told.
class FakePrefill final : public v1::PrefillService::Service {
 public:
  enum class Mode {
    kAnswerAbort,    // runs until aborted, then answers CANCELLED (writes stopped)
    kIgnoreAbort,    // runs until the caller gives up (a stuck or partitioned node)
    kReplyDeadline,  // answers DEADLINE_EXCEEDED at once (its own wait for the writes ran out)
    kReplyInvalid,   // answers INVALID_ARGUMENT at once (validation, nothing written)
  };
  std::atomic<Mode> mode{Mode::kAnswerAbort};
  std::atomic<int> prefills{0};
  std::atomic<int> last_ranges{0};
  std::atomic<bool> last_had_arena_key{false};

  grpc::Status Prefill(grpc::ServerContext* context, const v1::PrefillRequest* request,
                       v1::PrefillResponse*) override {
    ++prefills;
    last_ranges = request->kv_target().ranges_size();
    last_had_arena_key = !request->kv_target().remote_key().empty();
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    switch (mode.load()) {
      case Mode::kReplyDeadline:
        return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "KV writes did not complete");
      case Mode::kReplyInvalid:
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "kv_target.extents: bad");
      case Mode::kAnswerAbort:
        while (!Aborted(request->request_id()) && !context->IsCancelled() &&
               absl::Now() < give_up) {
          absl::SleepFor(absl::Milliseconds(2));
        }
        return grpc::Status(grpc::StatusCode::CANCELLED, "aborted");
      case Mode::kIgnoreAbort:
        while (!context->IsCancelled() && absl::Now() < give_up) {
          absl::SleepFor(absl::Milliseconds(2));
        }
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller");
    }
    return grpc::Status::OK;
  }

  grpc::Status Abort(grpc::ServerContext*, const v1::AbortRequest* request,
                     v1::AbortResponse* response) override {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : request->request_ids()) {
      aborted_.insert(id);
      response->add_aborted_request_ids(id);
    }
    return grpc::Status::OK;
  }

 private:
  bool Aborted(const std::string& id) {
    absl::MutexLock lock(&mu_);
    return aborted_.count(id) > 0;
  }
  absl::Mutex mu_;
  std::set<std::string> aborted_;
};

struct Server {
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

Server Serve(grpc::Service* service) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  Server s;
  s.server = builder.BuildAndStart();
  s.address = "127.0.0.1:" + std::to_string(port);
  return s;
}

// An address where nothing listens: a server that was started and stopped.
std::string DeadAddress() {
  FakePrefill unused;
  Server s = Serve(&unused);
  s.server->Shutdown();
  s.server->Wait();
  return s.address;
}

v1::PrefillRequest SomeRequest(const std::string& id) {
  v1::PrefillRequest r;
  r.set_request_id(id);
  r.add_prompt_token_ids(1);
  return r;
}

// PrefillClient alone: what each ending says about writes.
class PrefillClientTest : public ::testing::Test {
 protected:
  void SetUp() override { server_ = Serve(&fake_); }
  void TearDown() override {
    server_.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_.server->Wait();
  }
  PrefillOutcome Call(absl::Duration deadline, absl::Duration abort_wait = absl::Seconds(10)) {
    PrefillClient client(abort_wait);
    return client.Call(server_.address, SomeRequest("r1"), absl::Now() + deadline,
                       [] { return false; });
  }
  FakePrefill fake_;
  Server server_;
};

TEST_F(PrefillClientTest, DeadlineDuringPrefillAbortsAndTheCancelledAnswerFreesThePages) {
  fake_.mode = FakePrefill::Mode::kAnswerAbort;
  PrefillOutcome out = Call(absl::Seconds(1));
  EXPECT_EQ(out.response.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(out.expired);
  EXPECT_TRUE(out.sent);
  EXPECT_TRUE(out.peer_stopped) << out.response.status();
  EXPECT_EQ(out.hold, WriteHold::kNone);
}

TEST_F(PrefillClientTest, AbortLeftUnansweredHoldsThePages) {
  fake_.mode = FakePrefill::Mode::kIgnoreAbort;
  PrefillOutcome out = Call(absl::Seconds(1), /*abort_wait=*/absl::Milliseconds(200));
  EXPECT_TRUE(out.expired);
  EXPECT_FALSE(out.peer_stopped);
  EXPECT_EQ(out.hold, WriteHold::kAbortUnanswered);
}

TEST_F(PrefillClientTest, PeerTimeoutAnswerHoldsThePagesButValidationAnswersDoNot) {
  fake_.mode = FakePrefill::Mode::kReplyDeadline;
  PrefillOutcome out = Call(absl::Seconds(30));
  EXPECT_FALSE(out.expired);
  EXPECT_FALSE(out.peer_stopped);
  EXPECT_EQ(out.hold, WriteHold::kPeerGaveUp);
  fake_.mode = FakePrefill::Mode::kReplyInvalid;
  out = Call(absl::Seconds(30));
  EXPECT_EQ(out.response.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(out.peer_stopped);
}

TEST(PrefillClientConnectTest, RefusedConnectionSendsNothingAndHoldsNothing) {
  PrefillClient client(absl::Seconds(2));
  PrefillOutcome out = client.Call(DeadAddress(), SomeRequest("r1"),
                                   absl::Now() + absl::Seconds(30), [] { return false; });
  EXPECT_EQ(out.response.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(out.sent);
  EXPECT_TRUE(out.peer_stopped);
  EXPECT_NE(out.response.status().message().find("not sent"), std::string::npos)
      << out.response.status();
}

class FakeClock {
 public:
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

// The whole decode service over loopback, against the fake prefill node.
class DecodePagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/decode_service_test_" + std::to_string(getpid());
    ASSERT_TRUE(model::WriteRandomModel(*model::PresetConfig("tiny"), 3, dir_).ok());
    model_ = std::move(*model::Model::Load(dir_));
    const model::AttentionShape shape = model_->attention_shape();
    const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, 16};
    arena_ = std::move(*KvArena::Create(kv_shape.page_bytes(),
                                        shape.num_layers * shape.num_kv_heads * 256,
                                        {/*huge_pages=*/false}));
    const v1::ModelLayout layout = proto::LayoutFor(model_->config(), dir_, "hash", 16);
    transport_ = std::make_unique<transfer::LoopbackTransport>(
        transfer::LoopbackOptions{"decode-test", proto::CompatibilityOf(layout, 1)});
    arena_reg_ = std::move(*transport_->Register({arena_->base(), arena_->bytes()}, {true}));
    KvAdmissionOptions ao;
    ao.now = [this] { return clock_.Now(); };
    ao.release_thread = false;
    admission_ = std::make_unique<KvAdmission>(arena_.get(), ao);
    scheduler_ = std::make_unique<BatchScheduler>(model_.get(), admission_.get(),
                                                  shape.num_layers * shape.num_kv_heads, 16);
    metrics_ = std::make_unique<DecodeNodeMetrics>(&registry_, DecodeMetricsConfig{});
    prefill_ = Serve(&fake_);
  }

  void StartDecode(const std::string& prefill_address, absl::Duration abort_wait,
                   int64_t context_limit = 0) {
    DecodeServiceOptions o;
    o.context_limit = context_limit;
    PrefillPeers::Options peers;
    peers.addresses = {prefill_address};
    absl::StatusOr<std::unique_ptr<PrefillPeers>> created = PrefillPeers::Create(peers);
    ASSERT_TRUE(created.ok()) << created.status();
    o.prefill_peers = std::move(*created);
    o.default_policy = "fluxion";  // needs the sparse state: two reservations per request
    o.abort_wait = abort_wait;
    o.quarantine_lease = absl::Seconds(30);
    o.node_metrics = metrics_.get();
    v1::ServerInfo info;
    info.set_node_name("decode-test");
    *info.mutable_layout() = proto::LayoutFor(model_->config(), dir_, "hash", 16);
    service_ = std::make_unique<DecodeServiceImpl>(model_.get(), arena_.get(), admission_.get(),
                                                   scheduler_.get(), transport_.get(),
                                                   *arena_reg_->Describe(), info, o);
    decode_ = Serve(service_.get());
    stub_ = v1::DecodeService::NewStub(
        grpc::CreateChannel(decode_.address, grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    for (Server* s : {&decode_, &prefill_}) {
      if (s->server == nullptr) continue;
      s->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      s->server->Wait();
    }
    std::filesystem::remove_all(dir_);
  }

  // One Generate call with a `timeout_ms` budget; its final status.
  grpc::Status Generate(const std::string& id, uint32_t timeout_ms) {
    v1::GenerateRequest r;
    r.set_request_id(id);
    for (int i = 0; i < 40; ++i) r.add_prompt_token_ids(static_cast<uint32_t>(3 + i));
    r.set_timeout_ms(timeout_ms);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub_->Generate(&context, r);
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
    }
    return reader->Finish();
  }

  double Counter(const std::string& name, const metrics::Labels& labels = {}) {
    return registry_.AddCounter(name, "", labels)->value();
  }

  std::string dir_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<KvArena> arena_;
  std::unique_ptr<transfer::LoopbackTransport> transport_;
  std::unique_ptr<transfer::Registration> arena_reg_;
  FakeClock clock_;
  std::unique_ptr<KvAdmission> admission_;
  std::unique_ptr<BatchScheduler> scheduler_;
  metrics::Registry registry_;
  std::unique_ptr<DecodeNodeMetrics> metrics_;
  FakePrefill fake_;
  Server prefill_;
  std::unique_ptr<DecodeServiceImpl> service_;
  Server decode_;
  std::unique_ptr<v1::DecodeService::Stub> stub_;
};

TEST_F(DecodePagesTest, DeadlineDuringPrefillFreesPagesAtOnceWhenThePrefillNodeAnswers) {
  StartDecode(prefill_.address, absl::Seconds(10));
  // The channel to the prefill node is connected first (a request it refuses at once), so the
  // budgets below are spent on admission and the call, not on the connect.
  fake_.mode = FakePrefill::Mode::kReplyInvalid;
  ASSERT_EQ(Generate("warm-up", 30000).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  fake_.mode = FakePrefill::Mode::kAnswerAbort;
  const int prefills_before = fake_.prefills.load();
  std::vector<std::thread> clients;
  std::atomic<int> deadline_exceeded{0};
  for (int i = 0; i < 16; ++i) {
    clients.emplace_back([&, i] {
      if (Generate("short-" + std::to_string(i), 1000).error_code() ==
          grpc::StatusCode::DEADLINE_EXCEEDED) {
        ++deadline_exceeded;
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(deadline_exceeded.load(), 16);
  // The fake answers only when aborted, so every request ends by its deadline, however fast the
  // machine. Those that reached the prefill node (all but those a stalled machine kept from it for
  // a whole second: never sent, also freed at once, also an expiry) were aborted and answered.
  EXPECT_GE(fake_.prefills.load() - prefills_before, 1);
  // Nothing held for the 30 s lease: every page is free as soon as the calls returned.
  EXPECT_EQ(arena_->counters().quarantined, 0);
  EXPECT_EQ(arena_->counters().free, arena_->num_pages());
  EXPECT_EQ(Counter(names::kDecodePrefillExpiredTotal), 16);  // the warm-up was no expiry
  EXPECT_EQ(Counter(names::kTransferFailuresTotal, {{"cause", "deadline"}}), 0);
  // Per-reservation keys: one range per run (KV pages, sparse-state room), no arena-wide key.
  EXPECT_GE(fake_.last_ranges.load(), 2);
  EXPECT_FALSE(fake_.last_had_arena_key.load());
  // And the keys are revoked: only the arena's own registration is left.
  EXPECT_EQ(transport_->metrics().registrations, 1u);
}

// --max-model-len below the model's context: a gRPC client is held to it before anything is
// reserved or sent, in OpenAI's words.
TEST_F(DecodePagesTest, AContextLimitBelowTheModelsRefusesLongerPromptsBeforePrefill) {
  StartDecode(prefill_.address, absl::Seconds(10), /*context_limit=*/32);
  grpc::Status s = Generate("forty-tokens", 30000);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr("This model's maximum context length is 32 tokens. However, your "
                        "prompt resulted in 40 tokens."));
  EXPECT_EQ(fake_.prefills.load(), 0);
  EXPECT_EQ(arena_->counters().free, arena_->num_pages());
}

TEST_F(DecodePagesTest, RefusedConnectionFreesPagesAtOnceAndCountsATransportFailure) {
  StartDecode(DeadAddress(), absl::Seconds(10));
  grpc::Status s = Generate("refused", 30000);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_EQ(arena_->counters().quarantined, 0);
  EXPECT_EQ(arena_->counters().free, arena_->num_pages());
  EXPECT_EQ(Counter(names::kTransferFailuresTotal, {{"cause", "connect"}}), 1);
  EXPECT_EQ(Counter(names::kDecodePrefillExpiredTotal), 0);
  EXPECT_EQ(transport_->metrics().registrations, 1u);
}

TEST_F(DecodePagesTest, PeerThatMayStillWriteKeepsPagesQuarantinedForTheLeaseThenFrees) {
  fake_.mode = FakePrefill::Mode::kIgnoreAbort;
  StartDecode(prefill_.address, absl::Milliseconds(200));
  // The client cancels once the prefill node has the request (a deadline could pass before the
  // call was sent on a stalled machine, and nothing would be held); the decode node aborts the
  // prefill like at a deadline, the Abort goes unanswered for its 200 ms, and the pages are held.
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::GenerateRequest r;
    r.set_request_id("stuck");
    for (int i = 0; i < 40; ++i) r.add_prompt_token_ids(static_cast<uint32_t>(3 + i));
    auto reader = stub_->Generate(&context, r);
    ASSERT_TRUE(WaitFor([&] { return fake_.prefills.load() == 1; }));
    context.TryCancel();
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // The client's call ends at once; the node's side ends after its abort wait.
  ASSERT_TRUE(WaitFor([&] {
    return service_->live_requests() == 0 &&
           Counter(names::kKvQuarantinedReservationsTotal, {{"reason", "abort_unanswered"}}) >= 1;
  }));
  const int64_t held = arena_->counters().quarantined;
  EXPECT_GT(held, 0);
  EXPECT_EQ(arena_->counters().free, arena_->num_pages() - held);
  EXPECT_EQ(Counter(names::kKvQuarantinedReservationsTotal, {{"reason", "abort_unanswered"}}), 1);
  // The keys stay valid while the peer may write (KV range(s) and the state room's)...
  EXPECT_GT(transport_->metrics().registrations, 1u);
  clock_.Advance(absl::Seconds(30) - absl::Milliseconds(1));
  EXPECT_EQ(admission_->ReleaseExpired(), 0);
  EXPECT_EQ(arena_->counters().quarantined, held);
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(admission_->ReleaseExpired(), 2);  // the KV pages and the sparse-state room
  EXPECT_EQ(arena_->counters().free, arena_->num_pages());
  // ...and are revoked when the lease ends.
  EXPECT_EQ(transport_->metrics().registrations, 1u);
}

TEST_F(DecodePagesTest, ValidationAnswerFreesPagesAtOnceAndTheirKeysAreRevoked) {
  fake_.mode = FakePrefill::Mode::kReplyInvalid;
  StartDecode(prefill_.address, absl::Seconds(10));
  grpc::Status s = Generate("invalid", 30000);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(arena_->counters().free, arena_->num_pages());
  EXPECT_EQ(transport_->metrics().registrations, 1u);
}

}  // namespace
}  // namespace fluxion::decode
