// The router's vllm.grpc.engine.VllmEngine end to end over real processes (a prefill node, a
// decode node and a router, as `fluxion local` runs them: real gRPC, KV over real UCX), driven by
// a real gateway-side client: @grpc/grpc-js with @grpc/proto-loader loading our committed proto
// (tests/js/vllm/vllm_engine_client.cjs): HealthCheck, GetModelInfo, GetServerInfo, Generate from
// token ids (streaming and not), with a stop string and from text, an unsupported field, Abort
// mid-stream, a cancelled call, GetLoads.
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cluster/child_process.h"
#include "common/wait_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/transfer_secret_testing.h"

namespace fluxion::cluster {
namespace {

using ::fluxion::testing::TransferSecretArgs;

std::string SourceDir() {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return src ? src : ".";
}

struct Node {
  std::unique_ptr<ChildProcess> process;
  std::string address;
};

Node StartNode(const std::string& dir, const std::string& name, const std::string& command,
               std::vector<std::string> args) {
  Node node;
  const std::string port_file = dir + "/" + name + ".port";
  std::vector<std::string> argv = {FLUXION_BINARY, command,   "--listen",         "127.0.0.1:0",
                                   "--port-file",  port_file, "--metrics-listen", ""};
  for (std::string& a : TransferSecretArgs(command)) argv.push_back(std::move(a));
  argv.insert(argv.end(), args.begin(), args.end());
  auto child = ChildProcess::Start(name, argv, dir + "/" + name + ".log");
  if (!child.ok()) return node;
  node.process = std::move(*child);
  auto port = node.process->WaitForPortFile(port_file, absl::Seconds(60));
  if (port.ok()) node.address = absl::StrCat("127.0.0.1:", *port);
  return node;
}

TEST(VllmEngineE2eTest, GrpcJsClientDrivesTheRouter) {
  char tmpl[] = "/tmp/fluxion-vllm-e2e-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string model = SourceDir() + "/models/fluxion-tiny-retrieval";
  const std::vector<std::string> node = {"--model",   model, "--cpu-threads",     "1",
                                         "--ucx-tls", "tcp", "--ucx-net-devices", "lo"};
  Node prefill = StartNode(dir, "prefill", "prefill", node);
  ASSERT_FALSE(prefill.address.empty()) << "logs in " << dir;
  std::vector<std::string> decode_args = node;
  decode_args.insert(decode_args.end(),
                     {"--kv-pages", "8192", "--prefill-address", prefill.address});
  Node decode = StartNode(dir, "decode", "decode", decode_args);
  ASSERT_FALSE(decode.address.empty()) << "logs in " << dir;
  Node router = StartNode(dir, "router", "router",
                          {"--decode", decode.address, "--prefill", prefill.address, "--poll-ms",
                           "100", "--model-dir", model});
  ASSERT_FALSE(router.address.empty()) << "logs in " << dir;
  // Without --model-dir: token ids only; text input must name the flag.
  Node bare_router = StartNode(dir, "router-bare", "router",
                               {"--decode", decode.address, "--prefill", prefill.address});
  ASSERT_FALSE(bare_router.address.empty()) << "logs in " << dir;

  // NODE_PATH: the packages `npm ci` installed into the build tree from tests/js/vllm's lock.
  setenv("NODE_PATH", FLUXION_VLLM_JS_MODULES, 1);
  // FLUXION_VLLM_PROTO_ROOT runs the client with another copy of the proto, laid out as the
  // client loads it (vllm/grpc/engine/vllm_engine.proto and its imports under one root): SMG's
  // own, unchanged, is how docs/PROTOCOL.md checks that their clients work with ours.
  const char* proto_root_env = std::getenv("FLUXION_VLLM_PROTO_ROOT");
  const std::string proto_root =
      proto_root_env != nullptr && *proto_root_env != '\0' ? proto_root_env : SourceDir() + "/proto";
  const std::string log = dir + "/node.log";
  auto client =
      ChildProcess::Start("node",
                          {FLUXION_NODE, SourceDir() + "/tests/js/vllm/vllm_engine_client.cjs",
                           router.address, proto_root, bare_router.address},
                          log);
  ASSERT_TRUE(client.ok()) << client.status();
  // The script's own waits have deadlines of their own; this one only catches a hung script.
  WaitFor([&] { return !(*client)->Running(); }, 4 * kGenerousWait, absl::Milliseconds(50));
  const std::string ended = (*client)->Stop(absl::Seconds(1));
  EXPECT_EQ(ended, "had already exited 0") << (*client)->LogTail(6000) << "\nlogs in " << dir;
  EXPECT_THAT((*client)->LogTail(6000), ::testing::HasSubstr("all VllmEngine checks passed"));

  // Server reflection on every role (docs/PROTOCOL.md): grpcurl's view of each server.
  const std::vector<std::pair<const Node*, std::vector<std::string>>> reflected = {
      {&router,
       {"vllm.grpc.engine.VllmEngine", "fluxion.v1.DecodeService", "grpc.health.v1.Health"}},
      {&decode, {"fluxion.v1.DecodeService", "grpc.health.v1.Health"}},
      {&prefill, {"fluxion.v1.PrefillService", "grpc.health.v1.Health"}}};
  for (const auto& [node, services] : reflected) {
    std::vector<std::string> argv = {FLUXION_NODE,
                                     SourceDir() + "/tests/js/vllm/reflection_client.cjs",
                                     node->address};
    argv.insert(argv.end(), services.begin(), services.end());
    auto reflection = ChildProcess::Start("reflection", argv, dir + "/reflection.log");
    ASSERT_TRUE(reflection.ok()) << reflection.status();
    WaitFor([&] { return !(*reflection)->Running(); }, kGenerousWait, absl::Milliseconds(50));
    EXPECT_EQ((*reflection)->Stop(absl::Seconds(1)), "had already exited 0")
        << (*reflection)->LogTail(3000);
  }
}

}  // namespace
}  // namespace fluxion::cluster
