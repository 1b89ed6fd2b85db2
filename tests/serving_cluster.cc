#include "tests/serving_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>

#include "absl/time/clock.h"
#include "common/metrics_testing.h"
#include "tests/transfer_secret_testing.h"

namespace fluxion::testing {

namespace v1 = ::fluxion::v1;

std::string TinyModelDir() {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(src ? src : ".") + "/models/fluxion-tiny-retrieval";
}

std::vector<std::string> UcxArgs(const std::string& tls) {
  if (tls == "sm") {
    return {"--ucx-tls", "sm,self", "--noucx-peer-error-handling"};
  }
  return {"--ucx-tls", "tcp", "--ucx-net-devices", "lo"};
}

std::unique_ptr<ServerProcess> ServerProcess::Start(const std::string& command,
                                                    std::vector<std::string> args) {
  auto p = std::unique_ptr<ServerProcess>(new ServerProcess());
  char tmpl[] = "/tmp/fluxion-serving-XXXXXX";
  p->dir_ = mkdtemp(tmpl);
  const std::string port_file = p->dir_ + "/port", log = p->dir_ + "/log";
  const std::string metrics_port_file = p->dir_ + "/metrics_port";
  std::vector<std::string> argv = {FLUXION_BINARY, command, "--listen", "127.0.0.1:0",
                                   "--port-file", port_file,
                                   "--metrics-listen", "127.0.0.1:0",
                                   "--metrics-port-file", metrics_port_file};
  // The nodes compute; the router does not, and takes no --cpu-threads.
  if (command != "router") argv.insert(argv.end(), {"--cpu-threads", "1"});
  for (std::string& a : TransferSecretArgs(command)) argv.push_back(std::move(a));
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test, even when it crashes
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  p->pid_ = pid;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    std::ifstream in(port_file);
    if (in >> p->port_ && p->port_ > 0) {
      // The servers write the metrics port file before the gRPC one.
      std::ifstream metrics_in(metrics_port_file);
      if (metrics_in >> p->metrics_port_ && p->metrics_port_ > 0) return p;
      std::cerr << "server wrote no metrics port: " << p->Log() << "\n";
      return nullptr;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      p->pid_ = -1;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::cerr << "server did not start: " << p->Log() << "\n";
  return nullptr;
}

ServerProcess::~ServerProcess() { Kill(); }

void ServerProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

void ServerProcess::Signal(int signal) {
  if (pid_ > 0) kill(pid_, signal);
}

bool ServerProcess::Terminate(absl::Duration timeout) {
  if (pid_ <= 0) return true;
  kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return true;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  Kill();
  return false;
}

std::string ServerProcess::Log() const {
  std::ifstream in(dir_ + "/log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

DecodeClient::DecodeClient(const std::string& address)
    : stub_(v1::DecodeService::NewStub(
          grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}

GenerateResult DecodeClient::Generate(const v1::GenerateRequest& request,
                                      absl::Duration deadline,
                                      const std::function<void(const std::string&)>& on_accepted) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  auto reader = stub_->Generate(&context, request);
  if (on_accepted) {
    reader->WaitForInitialMetadata();
    const auto& metadata = context.GetServerInitialMetadata();
    auto it = metadata.find("fluxion-abort-token");
    on_accepted(it == metadata.end() ? std::string()
                                     : std::string(it->second.data(), it->second.size()));
  }
  GenerateResult out;
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (msg.has_chunk()) {
      for (uint32_t t : msg.chunk().token_ids()) out.tokens.push_back(t);
    } else if (msg.has_complete()) {
      out.has_complete = true;
      out.complete = msg.complete();
    } else if (msg.has_error()) {
      out.has_error = true;
      out.error = msg.error();
    }
  }
  out.status = reader->Finish();
  return out;
}

v1::DecodeLoad DecodeClient::Load() {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::DecodeLoad load;
  (void)stub_->GetLoad(&context, v1::GetLoadRequest(), &load);
  return load;
}

v1::DecodeLoad DecodeClient::WaitAllPagesFree(absl::Duration timeout) {
  // Idle, not only pages: a request's pages come back a moment before it leaves the running
  // count, and tests that check both after this call raced that gap.
  auto idle = [](const v1::DecodeLoad& l) {
    return l.free_kv_pages() == l.total_kv_pages() && l.running_requests() == 0 &&
           l.prefilling_requests() == 0 && l.waiting_requests() == 0;
  };
  return WaitForValue([this] { return Load(); }, idle, timeout, absl::Milliseconds(10));
}

bool DecodeClient::WaitForLoad(const std::function<bool(const v1::DecodeLoad&)>& done,
                               absl::Duration timeout) {
  return WaitFor([&] { return done(Load()); }, timeout);
}

v1::PrefillLoad PrefillLoadOf(const std::string& address) {
  auto stub = v1::PrefillService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::PrefillLoad load;
  (void)stub->GetLoad(&context, v1::GetLoadRequest(), &load);
  return load;
}

v1::GenerateRequest GreedyRequest(const std::string& id, const std::vector<uint32_t>& prompt,
                                  uint32_t max_tokens, const std::string& policy,
                                  const std::string& prefill_address) {
  v1::GenerateRequest r;
  r.set_request_id(id);
  for (uint32_t t : prompt) r.add_prompt_token_ids(t);
  r.mutable_sampling()->set_temperature(0);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  if (!policy.empty()) r.mutable_sparse()->set_policy(policy);
  if (!prefill_address.empty()) r.set_prefill_address(prefill_address);
  return r;
}

double MetricOf(const ServerProcess& server, const std::string& series) {
  auto body = metrics::testing::HttpGet(server.metrics_port(), "/metrics");
  if (!body.ok()) return std::numeric_limits<double>::quiet_NaN();
  return metrics::testing::SampleValue(*body, series);
}

std::vector<uint32_t> BytePrompt(const std::string& text) {
  std::vector<uint32_t> ids;
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

}  // namespace fluxion::testing
