// `fluxion serve` end to end, as a vLLM user runs it: one command starts the router, prefill and
// decode processes; the official `openai` npm SDK (tests/js/serve_e2e.mjs) checks that
// --served-model-name, --api-key and --max-model-len took effect; a decode node killed with
// SIGKILL is restarted on its port and the API serves again; SIGTERM stops every process and
// exits 0. Skipped without Node.js.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cluster/child_process.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

constexpr char kModelName[] = "tiny-served";
constexpr char kApiKey[] = "serve-e2e-key";
constexpr int kMaxModelLen = 512;

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls `path` until it holds `needle` or `timeout` passes.
bool WaitForText(const std::string& path, const std::string& needle, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (Slurp(path).find(needle) != std::string::npos) return true;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return false;
}

// tests/js/serve_e2e.mjs against the API on `http_port`; its output, and whether it passed.
bool RunSdkChecks(int http_port, std::string* output) {
  const std::string command = absl::StrCat(
      "cd '", FLUXION_JS_DIR, "' && FLUXION_HTTP=http://127.0.0.1:", http_port,
      "/v1 FLUXION_MODEL=", kModelName, " FLUXION_API_KEY_E2E=", kApiKey,
      " FLUXION_MAX_MODEL_LEN=", kMaxModelLen, " timeout 180 node serve_e2e.mjs 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return false;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) output->append(buf, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// decode-0's pid, or -1: `fluxion serve` prints it only at shutdown, so it is found in /proc as
// the process whose command line names decode-0's port file.
pid_t DecodePid(const std::string& dir) {
  const std::string needle = dir + "/decode-0.port";
  pid_t found = -1;
  DIR* proc = opendir("/proc");
  while (dirent* e = readdir(proc)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::string cmdline = Slurp(std::string("/proc/") + e->d_name + "/cmdline");
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;
    if (cmdline.find(needle) != std::string::npos) found = std::atoi(e->d_name);
  }
  closedir(proc);
  return found;
}

TEST(ServeTest, OneCommandServesTheSdkRestartsADeadNodeAndStopsOnSigterm) {
  if (std::system("node --version > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "Node.js not installed (Debian packages nodejs npm)";
  }
  struct stat st;
  ASSERT_EQ(stat(FLUXION_JS_DIR "/node_modules/openai", &st), 0)
      << "npm dependencies missing in " FLUXION_JS_DIR " (ctest fixture openai_js_deps)";
  char tmpl[] = "/tmp/fluxion-serve-test-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string out = dir + "/serve.out";
  auto serve = ChildProcess::Start(
      "serve",
      {FLUXION_BINARY, "serve", std::string(std::getenv("FLUXION_SOURCE_DIR")) +
                                    "/models/fluxion-tiny-retrieval",
       "--port", "0", "--log-dir", dir, "--served-model-name", kModelName, "--api-key", kApiKey,
       "--max-model-len", std::to_string(kMaxModelLen), "--cpu-threads", "1"},
      out);
  ASSERT_TRUE(serve.ok()) << serve.status();
  ASSERT_TRUE(WaitForText(out, "serving \"tiny-served\"", absl::Seconds(120)))
      << "not serving; output:\n" << Slurp(out);
  const int http_port = std::atoi(Slurp(dir + "/router.http-port").c_str());
  ASSERT_GT(http_port, 0);

  std::string sdk;
  EXPECT_TRUE(RunSdkChecks(http_port, &sdk)) << sdk;

  const pid_t decode = DecodePid(dir);
  ASSERT_GT(decode, 0) << "no decode-0 process";
  ASSERT_EQ(kill(decode, SIGKILL), 0);
  // Said at once, and again once it serves (the supervisor never waits for a model to load).
  ASSERT_TRUE(WaitForText(out, "decode-0 had already ended by signal 9; starting it again",
                          absl::Seconds(60)))
      << Slurp(out);
  ASSERT_TRUE(WaitForText(out, "decode-0 restarted on the same ports", absl::Seconds(120)))
      << Slurp(out);
  EXPECT_NE(DecodePid(dir), decode);
  sdk.clear();
  EXPECT_TRUE(RunSdkChecks(http_port, &sdk)) << "after the restart:\n" << sdk;

  ASSERT_EQ(kill((*serve)->pid(), SIGTERM), 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while ((*serve)->Running() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ((*serve)->Stop(absl::ZeroDuration()), "had already exited 0") << Slurp(out);
  const std::string log = Slurp(out);
  for (const char* name : {"router (pid", "decode-0 (pid", "prefill-0 (pid"}) {
    EXPECT_NE(log.find(name), std::string::npos) << name << " not stopped:\n" << log;
  }
  EXPECT_EQ(DecodePid(dir), -1) << "decode-0 outlived `fluxion serve`";
}

}  // namespace
}  // namespace fluxion::cluster
