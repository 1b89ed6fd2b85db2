#include "cluster/local_cluster.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cluster/backends.h"
#include "cluster/replay_run.h"
#include "common/cpu_threads.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/prefill_seal.h"

namespace fluxion::cluster {
namespace {

std::string SelfPath() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string("fluxion");
}

bool IsDir(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Replaces the value after `flag` ("host:0") by "host:port", so that a restarted child binds
// the port its peers already know.
void PinPort(std::vector<std::string>& args, const std::string& flag, int port) {
  auto it = std::find(args.begin(), args.end(), flag);
  if (it == args.end() || it + 1 == args.end()) return;
  std::string& value = *(it + 1);
  value = absl::StrCat(value.substr(0, value.rfind(':')), ":", port);
}

constexpr absl::Duration kShortestBackoff = absl::Seconds(1);
constexpr absl::Duration kLongestBackoff = absl::Minutes(1);

}  // namespace

std::string RepoRoot() {
  if (const char* env = std::getenv("FLUXION_SOURCE_DIR"); env != nullptr && *env) return env;
  std::string self = SelfPath();
  std::string dir = self.substr(0, self.rfind('/'));
  std::string parent = dir.substr(0, dir.rfind('/'));
  if (IsDir(parent + "/models") && IsDir(parent + "/cluster")) return parent;
  return ".";
}

void RegisterLocalClusterFlags(FlagSet& flags, LocalClusterOptions* o) {
  flags.String("model", &o->model, "model directory (Hugging Face layout) of every node");
  flags.Int("decode-nodes", &o->decode_nodes, "decode processes");
  flags.Int("prefill-nodes", &o->prefill_nodes, "prefill processes");
  flags.Int("cpu-threads", &o->cpu_threads,
            "--cpu-threads of each prefill/decode process (its one CPU pool); 0 = each node's "
            "own default (the CPUs it may use minus one)");
  flags.Int("kv-pages", &o->kv_pages, "KV pages per decode node");
  flags.String("ucx-tls", &o->ucx_tls, "UCX transports between the nodes: tcp (over lo) or sm");
  flags.String("decode-device", &o->decode_device,
               "--device of each decode node: cpu, or cuda (the hybrid CPU-GPU step)");
  flags.String("prefill-device", &o->prefill_device,
               "--device of each prefill node: cpu, or cuda (the GPU prefill)");
  flags.Double("startup-timeout-s", &o->startup_timeout_s, "how long to wait for the nodes");
}

absl::Status CheckLocalClusterOptions(const LocalClusterOptions& o) {
  if (o.cpu_threads < 0 || o.cpu_threads > kMaxCpuThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu-threads must be in [0, ", kMaxCpuThreads, "], got ", o.cpu_threads));
  }
  if (o.decode_nodes < 1 || o.prefill_nodes < 1 || o.decode_nodes > 64 || o.prefill_nodes > 64) {
    return absl::InvalidArgumentError("--decode-nodes and --prefill-nodes must be in [1, 64]");
  }
  if (o.ucx_tls != "tcp" && o.ucx_tls != "sm") {
    return absl::InvalidArgumentError("--ucx-tls must be tcp or sm");
  }
  if (!(o.startup_timeout_s > 0)) {
    return absl::InvalidArgumentError("--startup-timeout-s must be > 0");
  }
  if (!IsDir(o.model)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model ", o.model, " is not a directory (a Hugging Face model folder)"));
  }
  return absl::OkStatus();
}

LocalCluster::LocalCluster(LocalClusterOptions options, std::string logs)
    : o_(std::move(options)), logs_(std::move(logs)), self_(SelfPath()) {
  ucx_ = {"--ucx-tls", o_.ucx_tls == "tcp" ? "tcp" : "sm,self"};
  if (o_.ucx_tls == "tcp") {
    ucx_.insert(ucx_.end(), {"--ucx-net-devices", "lo"});
  } else {
    ucx_.push_back("--noucx-peer-error-handling");  // UCX 1.13's shared memory cannot do it
  }
}

absl::Status LocalCluster::Start() {
  // One fresh secret per run, shared by every node (sealed prefill requests, docs/SECURITY.md),
  // in the logs folder with mode 0600.
  transfer_secret_ = absl::StrCat(logs_, "/transfer.secret");
  FLUXION_RETURN_IF_ERROR(proto::WriteNewTransferSecret(transfer_secret_));
  std::cout << "starting " << o_.prefill_nodes << " prefill, " << o_.decode_nodes
            << " decode node(s) and a router; logs in " << logs_ << std::endl;
  FLUXION_RETURN_IF_ERROR(StartNodes("prefill", o_.prefill_nodes, &prefill_addresses_));
  FLUXION_RETURN_IF_ERROR(StartNodes("decode", o_.decode_nodes, &decode_addresses_));
  return StartRouter();
}

void LocalCluster::Shutdown() {
  for (auto it = children_.rbegin(); it != children_.rend(); ++it) {
    ChildProcess& p = *(*it)->process;
    std::string how = p.Stop(absl::Seconds(10));
    std::cout << "  " << p.name() << " (pid " << p.pid() << "): " << how << "\n";
  }
  children_.clear();
}

absl::Status LocalCluster::StartChild(Child& child) {
  for (const std::string& file : child.port_files) std::remove(file.c_str());
  std::vector<std::string> argv = {self_, child.command};
  argv.insert(argv.end(), child.args.begin(), child.args.end());
  auto process = ChildProcess::Start(child.name, argv, absl::StrCat(logs_, "/", child.name, ".log"));
  if (!process.ok()) return process.status();
  child.process = std::move(*process);
  child.started_at = absl::Now();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> LocalCluster::WaitForPorts(const std::vector<Child*>& children) {
  const absl::Duration timeout = absl::Seconds(o_.startup_timeout_s);
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<int> ports;
  for (Child* child : children) {
    for (const std::string& file : child->port_files) {
      while (true) {
        if (InterruptScope::interrupted()) return absl::CancelledError("interrupted");
        auto port = child->process->WaitForPortFile(file, absl::Milliseconds(200));
        if (port.ok()) {
          ports.push_back(*port);
          break;
        }
        if (port.status().code() != absl::StatusCode::kDeadlineExceeded) return port.status();
        if (absl::Now() > deadline) {
          return absl::DeadlineExceededError(absl::StrCat(
              child->name, " did not start serving within ", absl::FormatDuration(timeout),
              " (log: ", child->process->log_path(), ")"));
        }
      }
    }
  }
  return ports;
}

// gRPC and /metrics on free loopback ports, each written to a port file.
std::vector<std::string> LocalCluster::NodeArgs(const std::string& name) const {
  std::vector<std::string> a = {"--model",
                                o_.model,
                                "--listen",
                                "127.0.0.1:0",
                                "--port-file",
                                absl::StrCat(logs_, "/", name, ".port"),
                                "--metrics-listen",
                                "127.0.0.1:0",
                                "--metrics-port-file",
                                absl::StrCat(logs_, "/", name, ".metrics-port"),
                                "--cpu-threads",
                                std::to_string(o_.cpu_threads),
                                "--transfer-secret-file",
                                transfer_secret_};
  a.insert(a.end(), ucx_.begin(), ucx_.end());
  return a;
}

// Every decode node trusts every prefill node (the router names any of them); the list is rotated
// so that the nodes' own defaults start on different ones.
std::vector<std::string> LocalCluster::DecodeNodeArgs(int64_t i) const {
  std::vector<std::string> trusted;
  for (size_t k = 0; k < prefill_addresses_.size(); ++k) {
    trusted.push_back(prefill_addresses_[(i + k) % prefill_addresses_.size()]);
  }
  std::vector<std::string> a = {"--kv-pages",        std::to_string(o_.kv_pages),
                                "--prefill-address", absl::StrJoin(trusted, ","),
                                "--device",          o_.decode_device};
  a.insert(a.end(), o_.decode_args.begin(), o_.decode_args.end());
  return a;
}

absl::Status LocalCluster::StartNodes(const std::string& command, int64_t count,
                                      std::vector<std::string>* addresses) {
  std::vector<Child*> started;
  for (int64_t i = 0; i < count; ++i) {
    auto child = std::make_unique<Child>();
    child->name = absl::StrCat(command, "-", i);
    child->command = command;
    child->args = NodeArgs(child->name);
    std::vector<std::string> more = command == "decode"
                                        ? DecodeNodeArgs(i)
                                        : std::vector<std::string>{"--device", o_.prefill_device};
    child->args.insert(child->args.end(), more.begin(), more.end());
    child->port_files = {absl::StrCat(logs_, "/", child->name, ".port"),
                         absl::StrCat(logs_, "/", child->name, ".metrics-port")};
    FLUXION_RETURN_IF_ERROR(StartChild(*child));
    started.push_back(child.get());
    children_.push_back(std::move(child));
  }
  FLUXION_ASSIGN_OR_RETURN(std::vector<int> ports, WaitForPorts(started));
  for (size_t i = 0; i < started.size(); ++i) {
    PinPort(started[i]->args, "--listen", ports[2 * i]);
    PinPort(started[i]->args, "--metrics-listen", ports[2 * i + 1]);
    addresses->push_back(absl::StrCat("127.0.0.1:", ports[2 * i]));
    metrics_urls_.push_back(
        absl::StrCat(started[i]->name, " http://127.0.0.1:", ports[2 * i + 1], "/metrics"));
  }
  return absl::OkStatus();
}

// The router in front of every node, with the HTTP API; ready when it sees a healthy decode node.
absl::Status LocalCluster::StartRouter() {
  auto child = std::make_unique<Child>();
  child->name = child->command = "router";
  const std::string http_file = logs_ + "/router.http-port";
  const std::string port_file = logs_ + "/router.port";
  const std::string metrics_file = logs_ + "/router.metrics-port";
  child->args = {"--listen", "127.0.0.1:0", "--port-file", port_file, "--metrics-listen",
                 "127.0.0.1:0", "--metrics-port-file", metrics_file, "--decode",
                 absl::StrJoin(decode_addresses_, ","), "--prefill",
                 absl::StrJoin(prefill_addresses_, ","), "--http-listen", o_.http_listen,
                 "--http-port-file", http_file, "--model-dir", o_.model};
  child->args.insert(child->args.end(), o_.router_args.begin(), o_.router_args.end());
  child->port_files = {http_file, port_file, metrics_file};
  FLUXION_RETURN_IF_ERROR(StartChild(*child));
  Child& router = *child;
  children_.push_back(std::move(child));
  FLUXION_ASSIGN_OR_RETURN(std::vector<int> ports, WaitForPorts({&router}));
  PinPort(router.args, "--http-listen", ports[0]);
  PinPort(router.args, "--listen", ports[1]);
  PinPort(router.args, "--metrics-listen", ports[2]);
  http_port_ = ports[0];
  router_address_ = absl::StrCat("127.0.0.1:", ports[1]);
  metrics_urls_.insert(metrics_urls_.begin(),
                       absl::StrCat("router http://127.0.0.1:", ports[2], "/metrics"));
  return WaitForHealthyDecode(router);
}

absl::Status LocalCluster::WaitForHealthyDecode(Child& router) {
  auto channel = serving::CreateChannel(router_address_, serving::ChannelConfig());
  const absl::Time deadline = absl::Now() + absl::Seconds(o_.startup_timeout_s);
  while (!HealthServing(channel, "fluxion.v1.DecodeService", absl::Milliseconds(500))) {
    if (InterruptScope::interrupted()) return absl::CancelledError("interrupted");
    if (!router.process->Running()) {
      return absl::UnavailableError("the router exited; see " + router.process->log_path());
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          "the router found no healthy decode node; see the logs in " + logs_);
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::OkStatus();
}

std::vector<std::string> LocalCluster::RestartExited() {
  std::vector<std::string> lines;
  for (const std::unique_ptr<Child>& child : children_) {
    if (child->starting) {
      if (std::optional<std::string> line = CheckRestarted(*child)) lines.push_back(*line);
      continue;
    }
    if (child->process->Running() || absl::Now() < child->next_restart) continue;
    lines.push_back(Restart(*child));
  }
  return lines;
}

std::string LocalCluster::Restart(Child& child) {
  const std::string how = child.process->Stop(absl::ZeroDuration());
  const std::string log = child.process->log_path();
  // A child that served a while before exiting starts over from the shortest wait.
  const absl::Time now = absl::Now();
  const absl::Duration wait =
      now - child.started_at > kLongestBackoff ? kShortestBackoff : child.backoff;
  child.next_restart = now + wait;
  child.backoff = std::min(wait * 2, kLongestBackoff);
  if (absl::Status started = StartChild(child); !started.ok()) {
    return absl::StrCat(child.name, " ", how, " and did not restart (", started.message(),
                        "); next try in ", absl::FormatDuration(wait), ", log ", log);
  }
  child.starting = true;
  child.serving_deadline = now + absl::Seconds(o_.startup_timeout_s);
  return absl::StrCat(child.name, " ", how, "; starting it again on the same ports (pid ",
                      child.process->pid(), ", log ", log, ")");
}

std::optional<std::string> LocalCluster::CheckRestarted(Child& child) {
  absl::Status failed;
  for (const std::string& file : child.port_files) {
    absl::StatusOr<int> port = child.process->WaitForPortFile(file, absl::ZeroDuration());
    if (port.ok()) continue;
    if (port.status().code() != absl::StatusCode::kDeadlineExceeded) {
      failed = port.status();  // it exited before serving
    } else if (absl::Now() > child.serving_deadline) {
      failed = absl::DeadlineExceededError(absl::StrCat(
          "did not start serving within ", absl::FormatDuration(absl::Seconds(o_.startup_timeout_s))));
    } else {
      return std::nullopt;  // still starting
    }
    break;
  }
  child.starting = false;
  if (failed.ok()) {
    return absl::StrCat(child.name, " restarted on the same ports (pid ", child.process->pid(),
                        ")");
  }
  // Stopped, it counts as exited: the next restart comes after the backoff.
  child.process->Stop(absl::ZeroDuration());
  return absl::StrCat(child.name, " did not restart (", failed.message(), "); next try after ",
                      absl::FormatDuration(std::max(absl::ZeroDuration(),
                                                    child.next_restart - absl::Now())),
                      ", log ", child.process->log_path());
}

}  // namespace fluxion::cluster
