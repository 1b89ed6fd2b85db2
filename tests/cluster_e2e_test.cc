// The router in front of real `fluxion prefill` and `fluxion decode` processes (real gRPC, real
// UCX over TCP loopback): many requests succeed, `full` tokens pass through unchanged, overload is
// shed at once, and a decode node killed mid-stream fails its stream with a clear error while new
// requests go to the other node. The decode nodes sleep 2 ms after every step
// (--test-step-delay-ms), so a long request is still running when the test acts on it, on any
// machine; every wait is for a condition, with a generous deadline.
#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cluster/backends.h"
#include "cluster/child_process.h"
#include "cluster/openai_client.h"
#include "common/metrics_testing.h"
#include "common/wait_testing.h"
#include "cluster/replayer.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/transfer_secret_testing.h"

namespace fluxion::cluster {
namespace {

using ::fluxion::testing::TransferSecretArgs;

namespace v1 = ::fluxion::v1;
using ::testing::HasSubstr;
using ::testing::Not;

std::string ModelDir() {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(src ? src : ".") + "/models/fluxion-tiny-retrieval";
}

struct Node {
  std::unique_ptr<ChildProcess> process;
  std::string address;
};

// Starts `fluxion <command> <args> --listen 127.0.0.1:0 --port-file ...`; empty address on failure.
Node StartNode(const std::string& dir, const std::string& name, const std::string& command,
               std::vector<std::string> args) {
  Node node;
  const std::string port_file = dir + "/" + name + ".port";
  std::vector<std::string> argv = {FLUXION_BINARY, command, "--listen", "127.0.0.1:0",
                                   "--port-file", port_file};
  for (std::string& a : TransferSecretArgs(command)) argv.push_back(std::move(a));
  argv.insert(argv.end(), args.begin(), args.end());
  auto child = ChildProcess::Start(name, argv, dir + "/" + name + ".log");
  if (!child.ok()) return node;
  node.process = std::move(*child);
  auto port = node.process->WaitForPortFile(port_file, absl::Seconds(60));
  if (port.ok()) node.address = absl::StrCat("127.0.0.1:", *port);
  return node;
}

struct StreamResult {
  grpc::Status status;
  std::vector<uint32_t> tokens;
};

StreamResult Generate(const std::string& address, const v1::GenerateRequest& request,
                      std::chrono::seconds deadline = std::chrono::seconds(60)) {
  auto stub = v1::DecodeService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  StreamResult result;
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    for (uint32_t t : response.chunk().token_ids()) result.tokens.push_back(t);
  }
  result.status = reader->Finish();
  return result;
}

v1::GenerateRequest Greedy(const std::string& id, int prompt_tokens, uint32_t max_tokens,
                           const std::string& policy = "") {
  v1::GenerateRequest r;
  r.set_request_id(id);
  for (int i = 0; i < prompt_tokens; ++i) r.add_prompt_token_ids(32 + (i * 7) % 90);
  r.mutable_sampling()->set_temperature(0);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  if (!policy.empty()) r.mutable_sparse()->set_policy(policy);
  return r;
}

// One prefill node, two decode nodes, a router, and a second router that sheds everything.
class ClusterE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/fluxion-e2e-XXXXXX";
    dir_ = new std::string(mkdtemp(tmpl));
    const std::vector<std::string> node = {"--model", ModelDir(), "--cpu-threads", "1",
                                           "--ucx-tls", "tcp", "--ucx-net-devices", "lo"};
    prefill_ = new Node(StartNode(*dir_, "prefill", "prefill", node));
    if (prefill_->address.empty()) return;
    decodes_ = new std::vector<Node>();
    for (int i = 0; i < 2; ++i) {
      std::vector<std::string> args = node;
      args.insert(args.end(), {"--kv-pages", "8192", "--prefill-address", prefill_->address,
                               "--test-step-delay-ms", "2"});
      decodes_->push_back(StartNode(*dir_, absl::StrCat("decode-", i), "decode", args));
    }
    const std::string decode_list =
        absl::StrCat((*decodes_)[0].address, ",", (*decodes_)[1].address);
    router_ = new Node(StartNode(*dir_, "router", "router",
                                 {"--metrics-listen", "", "--decode", decode_list, "--prefill",
                                  prefill_->address, "--poll-ms", "100"}));
    shedding_router_ = new Node(StartNode(
        *dir_, "router-shed", "router",
        {"--metrics-listen", "", "--decode", decode_list, "--shed-kv-usage", "0"}));
  }
  static void TearDownTestSuite() {
    // Routers first, then decode nodes, then the prefill node (each SIGTERM, then SIGKILL).
    delete shedding_router_;
    delete router_;
    delete decodes_;
    delete prefill_;
    delete dir_;
  }
  void SetUp() override {
    ASSERT_FALSE(prefill_->address.empty()) << "prefill did not start; logs in " << *dir_;
    for (const Node& d : *decodes_) ASSERT_FALSE(d.address.empty()) << "logs in " << *dir_;
    ASSERT_FALSE(router_->address.empty()) << "logs in " << *dir_;
    ASSERT_FALSE(shedding_router_->address.empty()) << "logs in " << *dir_;
    // Ready once the routers see a healthy decode node.
    for (const Node* router : {router_, shedding_router_}) {
      auto channel = grpc::CreateChannel(router->address, grpc::InsecureChannelCredentials());
      ASSERT_TRUE(WaitFor([&] {
        return HealthServing(channel, "fluxion.v1.DecodeService", absl::Seconds(5));
      })) << "a router saw no healthy decode node; logs in " << *dir_;
    }
  }

  static std::string* dir_;
  static Node* prefill_;
  static std::vector<Node>* decodes_;
  static Node* router_;
  static Node* shedding_router_;
};
std::string* ClusterE2eTest::dir_ = nullptr;
Node* ClusterE2eTest::prefill_ = nullptr;
std::vector<Node>* ClusterE2eTest::decodes_ = nullptr;
Node* ClusterE2eTest::router_ = nullptr;
Node* ClusterE2eTest::shedding_router_ = nullptr;

TEST_F(ClusterE2eTest, DozensOfReplayedRequestsAllSucceed) {
  SyntheticOptions synthetic;
  synthetic.num_requests = 30;
  synthetic.rate = 10;
  synthetic.input = *ParseLengthDistribution("uniform:32:160");
  synthetic.output = *ParseLengthDistribution("fixed:6");
  ReplayOptions options;
  options.target = router_->address;
  options.progress = false;
  options.timeout_s = 60;
  options.vocab_size = 256;
  auto records = Replayer(options).Run(MakeSyntheticSchedule(synthetic));
  ASSERT_TRUE(records.ok()) << records.status();
  ReplayStats stats = ComputeStats(*records, Slo{});
  for (const RequestRecord& r : *records) {
    EXPECT_EQ(r.status_code, 0) << r.request_id << ": " << r.status_message;
    EXPECT_EQ(r.output_tokens, 6) << r.request_id;
  }
  EXPECT_EQ(stats.succeeded, 30);
}

TEST_F(ClusterE2eTest, FullPolicyTokensPassThroughTheRouterUnchanged) {
  // The decode node's own `full` answer equals single-process generation (tests/serving_test.cc);
  // through the router, and from either decode node, it must be the same.
  StreamResult routed = Generate(router_->address, Greedy("full-router", 120, 16, "full"));
  ASSERT_TRUE(routed.status.ok()) << routed.status.error_message();
  ASSERT_EQ(routed.tokens.size(), 16u);
  for (int i = 0; i < 2; ++i) {
    v1::GenerateRequest direct = Greedy(absl::StrCat("full-direct-", i), 120, 16, "full");
    direct.set_prefill_address(prefill_->address);
    StreamResult d = Generate((*decodes_)[i].address, direct);
    ASSERT_TRUE(d.status.ok()) << d.status.error_message();
    EXPECT_EQ(d.tokens, routed.tokens) << "decode-" << i;
  }
}

TEST_F(ClusterE2eTest, OverloadIsShedAtOnceNotQueued) {
  // --shed-kv-usage 0: every node is always over the threshold, so a router that queued the
  // request would hold it until the call's deadline (DEADLINE_EXCEEDED); it is refused instead.
  StreamResult r = Generate(shedding_router_->address, Greedy("shed-1", 64, 4));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(r.status.error_message(), HasSubstr("KV usage threshold"));
}

TEST_F(ClusterE2eTest, ClientCancellationThroughTheRouterReleasesDecodePages) {
  SyntheticOptions synthetic;
  synthetic.num_requests = 8;
  synthetic.rate = 20;
  synthetic.input = *ParseLengthDistribution("fixed:96");
  // Every request is cancelled 0.4 s after it was sent, long before it could end by itself:
  // 1,500 tokens take at least 3 s on the decode nodes (2 ms after every step), so the count below
  // does not depend on how fast the machine is.
  synthetic.output = *ParseLengthDistribution("fixed:1500");
  ReplayOptions options;
  options.target = router_->address;
  options.progress = false;
  options.vocab_size = 256;
  options.cancel_fraction = 1.0;
  options.cancel_after_s = 0.4;
  auto records = Replayer(options).Run(MakeSyntheticSchedule(synthetic));
  ASSERT_TRUE(records.ok()) << records.status();
  ReplayStats stats = ComputeStats(*records, Slo{});
  EXPECT_EQ(stats.cancelled, 8) << "failed: " << stats.failed;
  // Both decode nodes give every page back (cancellation reached them through the router, and
  // from them the prefill node): long before the requests could have ended by themselves.
  for (int i = 0; i < 2; ++i) {
    auto d = v1::DecodeService::NewStub(
        grpc::CreateChannel((*decodes_)[i].address, grpc::InsecureChannelCredentials()));
    v1::DecodeLoad load;
    // Both: a cancelled request's pages go back before it leaves the running set, so a load
    // read between the two saw every page free and one request still running.
    WaitFor([&] {
      grpc::ClientContext c;
      c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      return d->GetLoad(&c, v1::GetLoadRequest(), &load).ok() &&
             load.free_kv_pages() == load.total_kv_pages() && load.running_requests() == 0;
    });
    EXPECT_EQ(load.free_kv_pages(), load.total_kv_pages()) << "decode-" << i;
    EXPECT_EQ(load.running_requests(), 0u) << "decode-" << i;
  }
}

// Last: it kills a decode node.
TEST_F(ClusterE2eTest, ZKilledDecodeNodeFailsItsStreamClearlyAndNewRequestsGoElsewhere) {
  auto stub = v1::DecodeService::NewStub(
      grpc::CreateChannel(router_->address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub->Generate(&context, Greedy("long-1", 64, 2000));
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response)) << "no first token";
  // Which decode node is running it? The one holding KV pages (the other is idle).
  int victim = -1;
  for (int i = 0; i < 2 && victim < 0; ++i) {
    auto d = v1::DecodeService::NewStub(
        grpc::CreateChannel((*decodes_)[i].address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::DecodeLoad load;
    if (d->GetLoad(&c, v1::GetLoadRequest(), &load).ok() &&
        (load.running_requests() > 0 || load.free_kv_pages() < load.total_kv_pages())) {
      victim = i;
    }
  }
  ASSERT_GE(victim, 0);
  kill((*decodes_)[victim].process->pid(), SIGKILL);
  while (reader->Read(&response)) {
  }
  // The router noticed the death: a stream it had not seen end would run into the call's 60 s
  // deadline instead, without naming the node.
  grpc::Status status = reader->Finish();
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.error_message(), Not(HasSubstr((*decodes_)[victim].address)))
      << "a node's address is for the router's log, not the client";
  EXPECT_THAT(status.error_message(), HasSubstr("after the first token"));

  // New requests succeed on the surviving node (the first may try the dead one and retry).
  for (int i = 0; i < 4; ++i) {
    StreamResult r = Generate(router_->address, Greedy(absl::StrCat("after-kill-", i), 48, 4));
    EXPECT_TRUE(r.status.ok()) << i << ": " << r.status.error_message();
    EXPECT_EQ(r.tokens.size(), 4u);
  }
}

// llm-d's prefill pick (issue 16): two prefill nodes, one decode node trusting both, a router with
// the OpenAI HTTP API, as the decode pod's sidecar runs. The pick reaches the prefill node it names
// over HTTP (the header) and gRPC (call metadata); a pick that is not one of the router's prefill
// nodes is HTTP 400 / INVALID_ARGUMENT (docs/DEPLOY.md, "Behind llm-d's router").
class PrefillPickE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/fluxion-pick-XXXXXX";
    dir_ = new std::string(mkdtemp(tmpl));
    nodes_ = new std::vector<Node>();
    const std::vector<std::string> node = {"--model", ModelDir(), "--cpu-threads", "1",
                                           "--ucx-tls", "tcp", "--ucx-net-devices", "lo"};
    std::vector<std::string> prefills;
    for (int i = 0; i < 2; ++i) {
      std::vector<std::string> args = node;
      args.insert(args.end(), {"--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                               absl::StrCat(*dir_, "/prefill-", i, ".mport")});
      nodes_->push_back(StartNode(*dir_, absl::StrCat("prefill-", i), "prefill", args));
      prefills.push_back(nodes_->back().address);
    }
    const std::string prefill_list = absl::StrCat(prefills[0], ",", prefills[1]);
    std::vector<std::string> decode = node;
    decode.insert(decode.end(), {"--kv-pages", "4096", "--prefill-address", prefill_list});
    nodes_->push_back(StartNode(*dir_, "decode", "decode", decode));
    nodes_->push_back(StartNode(*dir_, "router", "router",
                                {"--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                                 *dir_ + "/router.mport", "--decode", nodes_->back().address,
                                 "--prefill", prefill_list, "--poll-ms", "100", "--model-dir",
                                 ModelDir(), "--http-listen", "127.0.0.1:0", "--http-port-file",
                                 *dir_ + "/http.port"}));
  }
  static void TearDownTestSuite() {
    // Router, decode node, then the prefill nodes.
    while (!nodes_->empty()) nodes_->pop_back();
    delete nodes_;
    delete dir_;
  }
  void SetUp() override {
    for (const Node& n : *nodes_) ASSERT_FALSE(n.address.empty()) << "logs in " << *dir_;
    auto port = (*nodes_)[3].process->WaitForPortFile(*dir_ + "/http.port", kGenerousWait);
    ASSERT_TRUE(port.ok()) << port.status();
    http_port_ = *port;
    // Ready once the router counts both prefill nodes healthy: a pick of a node not yet polled
    // healthy would fall back to the router's own pick.
    ASSERT_TRUE(WaitFor([&] {
      auto m = metrics::testing::HttpGet(RouterMetricsPort(), "/metrics");
      return m.ok() && absl::StrContains(*m, R"(fluxion_router_backends_healthy{role="prefill"} 2)");
    })) << "the router did not see both prefill nodes healthy; logs in " << *dir_;
  }
  static int RouterMetricsPort() {
    auto port = (*nodes_)[3].process->WaitForPortFile(*dir_ + "/router.mport", kGenerousWait);
    return port.ok() ? *port : -1;
  }
  // Prefill calls prefill node `i` answered OK (its /metrics).
  static double PrefillOk(int i) {
    auto port = (*nodes_)[i].process->WaitForPortFile(
        absl::StrCat(*dir_, "/prefill-", i, ".mport"), kGenerousWait);
    if (!port.ok()) return -1;
    auto body = metrics::testing::HttpGet(*port, "/metrics");
    if (!body.ok()) return -1;
    const std::string key = "fluxion_prefill_requests_total{code=\"OK\"} ";
    size_t at = body->find(key);
    double v = 0;
    if (at == std::string::npos) return 0;
    const size_t end = body->find('\n', at);
    (void)absl::SimpleAtod(body->substr(at + key.size(), end - at - key.size()), &v);
    return v;
  }
  static absl::StatusOr<std::string> Complete(const std::string& pick) {
    const std::string json =
        R"({"model":"fluxion-tiny-retrieval","prompt":"The key is","max_tokens":3,"temperature":0})";
    std::vector<std::pair<std::string, std::string>> headers;
    if (!pick.empty()) headers.emplace_back("x-prefiller-host-port", pick);
    return openai::PostJsonToLoopback(http_port_, "/v1/completions", json, absl::Seconds(60),
                                      headers);
  }

  static std::string* dir_;
  static std::vector<Node>* nodes_;  // prefill-0, prefill-1, decode, router
  static int http_port_;
};
std::string* PrefillPickE2eTest::dir_ = nullptr;
std::vector<Node>* PrefillPickE2eTest::nodes_ = nullptr;
int PrefillPickE2eTest::http_port_ = 0;

TEST_F(PrefillPickE2eTest, HttpHeaderAndGrpcMetadataReachTheNamedPrefillNode) {
  for (int round = 0; round < 2; ++round) {
    for (int target : {1, 0}) {
      const double before_target = PrefillOk(target), before_other = PrefillOk(1 - target);
      absl::StatusOr<std::string> body = Complete((*nodes_)[target].address);
      ASSERT_TRUE(body.ok()) << body.status();
      EXPECT_EQ(PrefillOk(target), before_target + 1) << "round " << round;
      EXPECT_EQ(PrefillOk(1 - target), before_other) << "round " << round;
    }
  }
  // gRPC (fluxion.v1 on the router's port), the same key as call metadata.
  auto stub = v1::DecodeService::NewStub(
      grpc::CreateChannel((*nodes_)[3].address, grpc::InsecureChannelCredentials()));
  for (int target : {0, 1}) {
    const double before = PrefillOk(target);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    context.AddMetadata("x-prefiller-host-port", (*nodes_)[target].address);
    auto reader = stub->Generate(&context, Greedy(absl::StrCat("pick-grpc-", target), 40, 3));
    v1::GenerateResponse response;
    while (reader->Read(&response)) {
    }
    grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(PrefillOk(target), before + 1);
  }
}

TEST_F(PrefillPickE2eTest, APickThatIsNoneOfOurPrefillNodesIsA400) {
  const double before = PrefillOk(0) + PrefillOk(1);
  absl::StatusOr<std::string> body = Complete("10.77.0.9:8000");
  ASSERT_FALSE(body.ok());
  EXPECT_THAT(body.status().message(), HasSubstr("400"));
  EXPECT_THAT(body.status().message(), HasSubstr("x-prefiller-host-port"));
  EXPECT_THAT(body.status().message(), HasSubstr("names no prefill node of this router"));
  EXPECT_EQ(PrefillOk(0) + PrefillOk(1), before);
  // Without the header the router picks.
  EXPECT_TRUE(Complete("").ok());
}

}  // namespace
}  // namespace fluxion::cluster
