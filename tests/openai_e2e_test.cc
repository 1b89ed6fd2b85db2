// The official `openai` npm SDK against `fluxion router`'s OpenAI-compatible HTTP API, over real
// `fluxion prefill` / `fluxion decode` processes (real gRPC, real UCX over TCP loopback) with the
// tiny model: starts the nodes and three routers (serving, shedding everything, without a healthy
// decode node), then runs tests/js/openai_e2e.mjs with Node.js, whose npm dependencies the
// `openai_js_deps` ctest fixture installed with `npm ci` into the build tree.
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cluster/child_process.h"
#include "gtest/gtest.h"
#include "tests/transfer_secret_testing.h"

namespace fluxion::cluster {
namespace {

using ::fluxion::testing::TransferSecretArgs;

std::string ModelDir() {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(src ? src : ".") + "/models/fluxion-tiny-retrieval";
}

struct Node {
  std::unique_ptr<ChildProcess> process;
  std::string address;
  int http_port = 0;
  int metrics_port = 0;
};

int ReadPort(ChildProcess& process, const std::string& file) {
  auto port = process.WaitForPortFile(file, absl::Seconds(60));
  return port.ok() ? *port : 0;
}

// `fluxion <command> <args> --listen 127.0.0.1:0 --port-file ...`; empty address on failure.
// `http`: also the HTTP API on a free port (routers).
Node StartNode(const std::string& dir, const std::string& name, const std::string& command,
               std::vector<std::string> args, bool http) {
  Node node;
  const std::string port_file = dir + "/" + name + ".port";
  const std::string http_file = dir + "/" + name + ".http-port";
  const std::string metrics_file = dir + "/" + name + ".metrics-port";
  std::vector<std::string> argv = {FLUXION_BINARY,     command,       "--listen",
                                   "127.0.0.1:0",      "--port-file", port_file,
                                   "--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                                   metrics_file};
  if (http) {
    argv.insert(argv.end(), {"--http-listen", "127.0.0.1:0", "--http-port-file", http_file,
                             "--model-dir", ModelDir()});
  }
  for (std::string& a : TransferSecretArgs(command)) argv.push_back(std::move(a));
  argv.insert(argv.end(), args.begin(), args.end());
  auto child = ChildProcess::Start(name, argv, dir + "/" + name + ".log");
  if (!child.ok()) return node;
  node.process = std::move(*child);
  const int port = ReadPort(*node.process, port_file);
  if (port == 0) return node;
  node.address = absl::StrCat("127.0.0.1:", port);
  node.metrics_port = ReadPort(*node.process, metrics_file);
  if (http) node.http_port = ReadPort(*node.process, http_file);
  return node;
}

bool HaveNode() { return std::system("node --version > /dev/null 2>&1") == 0; }

TEST(OpenAiE2eTest, OpenAiSdkAgainstTheRouter) {
  if (!HaveNode()) GTEST_SKIP() << "Node.js not installed (Debian packages nodejs npm)";
  struct stat st;
  ASSERT_EQ(stat(FLUXION_JS_DIR "/node_modules/openai", &st), 0)
      << "npm dependencies missing in " FLUXION_JS_DIR " (ctest fixture openai_js_deps)";
  char tmpl[] = "/tmp/fluxion-openai-e2e-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::vector<std::string> ucx = {"--ucx-tls", "tcp", "--ucx-net-devices", "lo"};
  std::vector<std::string> node_args = {"--model", ModelDir(), "--cpu-threads", "1"};
  node_args.insert(node_args.end(), ucx.begin(), ucx.end());
  Node prefill = StartNode(dir, "prefill", "prefill", node_args, false);
  ASSERT_FALSE(prefill.address.empty()) << "prefill did not start; logs in " << dir;
  std::vector<std::string> decode_args = node_args;
  decode_args.insert(decode_args.end(),
                     {"--kv-pages", "4096", "--prefill-address", prefill.address});
  Node decode = StartNode(dir, "decode", "decode", decode_args, false);
  ASSERT_FALSE(decode.address.empty()) << "decode did not start; logs in " << dir;
  Node router = StartNode(dir, "router", "router",
                          {"--decode", decode.address, "--prefill", prefill.address, "--poll-ms",
                           "100", "--api-key", "e2e-key"},
                          true);
  Node shedding = StartNode(dir, "router-shed", "router",
                            {"--decode", decode.address, "--prefill", prefill.address, "--poll-ms",
                             "100", "--shed-kv-usage", "0"},
                            true);
  // Port 1 on loopback: nothing listens, so the router never has a healthy decode node.
  Node down = StartNode(dir, "router-down", "router", {"--decode", "127.0.0.1:1"}, true);
  for (const Node* r : {&router, &shedding, &down}) {
    ASSERT_NE(r->http_port, 0) << "a router did not start its HTTP API; logs in " << dir;
  }
  // The serving routers must have seen the decode node healthy (the first poll) before the
  // script's first request: wait on their /health, with a generous deadline.
  const std::string wait_ready =
      absl::StrCat("timeout 60 sh -c 'until curl -sf http://127.0.0.1:", router.http_port,
                   "/health >/dev/null && curl -sf http://127.0.0.1:", shedding.http_port,
                   "/health >/dev/null; do sleep 0.05; done'");
  ASSERT_EQ(std::system(wait_ready.c_str()), 0) << "routers not ready; logs in " << dir;

  const std::string command =
      absl::StrCat("cd '", FLUXION_JS_DIR, "' && FLUXION_HTTP=http://127.0.0.1:", router.http_port,
                   "/v1 FLUXION_SHED_HTTP=http://127.0.0.1:", shedding.http_port,
                   "/v1 FLUXION_DOWN_HTTP=http://127.0.0.1:", down.http_port,
                   "/v1 FLUXION_DECODE_METRICS=http://127.0.0.1:", decode.metrics_port,
                   "/metrics FLUXION_API_KEY_E2E=e2e-key FLUXION_MODEL=fluxion-tiny-retrieval "
                   "FLUXION_CHAT=", FLUXION_E2E_CHAT,
                   " timeout 240 node openai_e2e.mjs 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  const int status = pclose(pipe);
  std::cout << output;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "openai_e2e.mjs failed; node logs in " << dir;
}

}  // namespace
}  // namespace fluxion::cluster
