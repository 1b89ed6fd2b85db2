// End to end over real processes: `fluxion local` (router + prefill + decode, real gRPC, real UCX
// over TCP loopback) replaying a trace, its Ctrl-C path, and the `fluxion router` binary's
// /metrics endpoint checked by promtool.
#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cluster/fake_decode_service.h"
#include "common/metrics_testing.h"
#include "common/wait_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster {
namespace {

using ::testing::HasSubstr;

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A `fluxion` child with stdout+stderr in `log`.
pid_t Spawn(std::vector<std::string> args, const std::string& log) {
  args.insert(args.begin(), FLUXION_BINARY);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    FILE* f = std::fopen(log.c_str(), "w");
    dup2(fileno(f), 1);
    dup2(fileno(f), 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Exit code, or -1 if it did not exit within `timeout` (then it is killed).
int WaitExit(pid_t pid, std::chrono::seconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

// Processes whose command line mentions `needle` (the run's unique output directory).
std::vector<std::string> ProcessesMentioning(const std::string& needle) {
  std::vector<std::string> found;
  DIR* proc = opendir("/proc");
  while (dirent* e = readdir(proc)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::string cmdline = Slurp(std::string("/proc/") + e->d_name + "/cmdline");
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;
    if (cmdline.find(needle) != std::string::npos) found.push_back(cmdline);
  }
  closedir(proc);
  return found;
}

std::string FreshDir(const std::string& name) {
  std::string dir = ::testing::TempDir() + "/" + name + "-" + std::to_string(getpid());
  std::system(("rm -rf '" + dir + "'").c_str());
  return dir;
}

TEST(LocalClusterTest, ReplaysATraceThroughRealProcessesAndShutsDownCleanly) {
  const std::string dir = FreshDir("fluxion-local");
  pid_t pid = Spawn({"local", "--out-dir", dir, "--max-requests", "8", "--time-scale", "1",
                     "--json", dir + "-summary.json"},
                    dir + ".log");
  int code = WaitExit(pid, std::chrono::seconds(120));
  std::string log = Slurp(dir + ".log");
  ASSERT_EQ(code, 0) << log;
  EXPECT_THAT(log, HasSubstr("cluster ready"));
  // Every node's /metrics URL is printed.
  EXPECT_THAT(log, HasSubstr("router http://127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("prefill-0 http://127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("decode-0 http://127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("8 sent, 8 succeeded, 0 failed"));
  EXPECT_THAT(log, HasSubstr("router (pid"));
  // The closing question, in the form the tiny model was trained on, answered right through the
  // router's HTTP API.
  EXPECT_THAT(log, HasSubstr("  expected: 2390561\n  model:    2390561 (right)"));
  nlohmann::json summary = nlohmann::json::parse(Slurp(dir + "-summary.json"));
  EXPECT_EQ(summary["succeeded"], 8);
  EXPECT_GT(summary["ttft_ms"]["p50"].get<double>(), 0);
  EXPECT_GT(summary["output_tokens"].get<int>(), 8);
  EXPECT_TRUE(std::ifstream(dir + "/requests.csv").good());
  EXPECT_TRUE(ProcessesMentioning(dir).empty()) << "left behind: " << ProcessesMentioning(dir)[0];
}

// The router's /metrics port as `fluxion local` prints it ("router http://127.0.0.1:PORT/metrics"),
// or 0.
int RouterMetricsPort(const std::string& log) {
  const std::string key = "router http://127.0.0.1:";
  const size_t at = log.find(key);
  if (at == std::string::npos) return 0;
  return std::atoi(log.c_str() + at + key.size());
}

TEST(LocalClusterTest, CtrlCStopsTheReplayAndLeavesNoProcesses) {
  const std::string dir = FreshDir("fluxion-local-int");
  pid_t pid = Spawn({"local", "--out-dir", dir, "--max-requests", "40", "--time-scale", "2"},
                    dir + ".log");
  ASSERT_TRUE(WaitFor([&] {
    return Slurp(dir + ".log").find("cluster ready") != std::string::npos;
  }, kGenerousWait, absl::Milliseconds(50))) << Slurp(dir + ".log");
  // Interrupted once the replay is under way: the router has begun answering requests.
  const int router_metrics = RouterMetricsPort(Slurp(dir + ".log"));
  ASSERT_GT(router_metrics, 0) << Slurp(dir + ".log");
  EXPECT_TRUE(WaitFor([&] {
    auto body = metrics::testing::HttpGet(router_metrics, "/metrics");
    return body.ok() && body->find("fluxion_router_requests_total{") != std::string::npos;
  }, kGenerousWait, absl::Milliseconds(50))) << "no request reached the router";
  kill(pid, SIGINT);
  int code = WaitExit(pid, std::chrono::seconds(60));
  std::string log = Slurp(dir + ".log");
  EXPECT_EQ(code, 130) << log;
  EXPECT_THAT(log, HasSubstr("shutting down"));
  EXPECT_THAT(log, HasSubstr("decode-0 (pid"));
  EXPECT_TRUE(ProcessesMentioning(dir).empty()) << "left behind: " << ProcessesMentioning(dir)[0];
}

TEST(LocalClusterTest, RouterBinaryServesMetricsThatPassPromtool) {
  // The `fluxion` binary carries OpenBLAS and glog, whose static TLS shrinks every thread's stack;
  // this runs the real binary's /metrics thread (it once overflowed there).
  testing::FakeDecodeService decode;
  testing::FakeServer server(&decode, "fluxion.v1.DecodeService");
  const std::string dir = FreshDir("fluxion-router");
  std::system(("mkdir -p '" + dir + "'").c_str());
  pid_t pid = Spawn({"router", "--listen", "127.0.0.1:0", "--port-file", dir + "/port",
                     "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", dir + "/mport",
                     "--decode", server.address()},
                    dir + "/log");
  int port = 0;
  WaitFor([&] {
    std::ifstream in(dir + "/mport");
    return static_cast<bool>(in >> port) && port > 0;
  }, kGenerousWait, absl::Milliseconds(20));
  ASSERT_GT(port, 0) << Slurp(dir + "/log");
  // Once the first health poll has counted the fake decode node.
  absl::StatusOr<std::string> body;
  WaitFor([&] {
    body = metrics::testing::HttpGet(port, "/metrics");
    return body.ok() &&
           body->find("fluxion_router_backends_healthy{role=\"decode\"} 1") != std::string::npos;
  });
  ASSERT_TRUE(body.ok()) << body.status() << Slurp(dir + "/log");
  EXPECT_THAT(*body, HasSubstr("fluxion_router_backends_healthy{role=\"decode\"} 1"));
  if (metrics::testing::HavePromtool()) {
    absl::Status check = metrics::testing::PromtoolCheck(*body);
    EXPECT_TRUE(check.ok()) << check << "\n" << *body;
  }
  kill(pid, SIGTERM);
  EXPECT_EQ(WaitExit(pid, std::chrono::seconds(60)), 0) << Slurp(dir + "/log");
}

}  // namespace
}  // namespace fluxion::cluster
