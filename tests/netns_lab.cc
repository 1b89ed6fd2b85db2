#include "tests/netns_lab.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/wait_testing.h"

namespace fluxion::testing {
namespace {

constexpr char kPrefix[] = "fxf";  // every namespace and link of this suite starts with it
// The NFQUEUE number of the delay rules; queues are per namespace, so every host can use it.
constexpr char kDelayQueue[] = "7";

// Runs argv and returns its exit status and combined output.
absl::StatusOr<std::pair<int, std::string>> RunCapture(const std::vector<std::string>& argv) {
  char tmpl[] = "/tmp/fluxion-netns-cmd-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return absl::InternalError("mkstemp failed");
  const pid_t pid = fork();
  if (pid < 0) {
    close(fd);
    unlink(tmpl);
    return absl::InternalError("fork failed");
  }
  if (pid == 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> cargv;
    for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    execvp(cargv[0], cargv.data());
    _exit(127);
  }
  close(fd);
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(tmpl);
  std::stringstream ss;
  ss << in.rdbuf();
  unlink(tmpl);
  return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), ss.str());
}

bool PidAlive(int pid) { return kill(pid, 0) == 0 || errno == EPERM; }

// Namespaces and bridges "fxf<pid>..." of processes that no longer exist: a run killed before its
// destructor ran. Removed so that they do not pile up on a CI machine.
void RemoveLeftovers() {
  auto netns = RunCapture({"ip", "netns", "list"});
  std::set<int> dead;
  auto owner = [&](absl::string_view name) {
    if (!absl::ConsumePrefix(&name, kPrefix)) return 0;
    int pid = 0;
    std::string digits;
    for (char c : name) {
      if (c < '0' || c > '9') break;
      digits.push_back(c);
    }
    return absl::SimpleAtoi(digits, &pid) ? pid : 0;
  };
  if (netns.ok()) {
    for (absl::string_view line : absl::StrSplit(netns->second, '\n', absl::SkipEmpty())) {
      std::string name(line.substr(0, line.find(' ')));
      const int pid = owner(name);
      if (pid > 0 && pid != getpid() && !PidAlive(pid)) {
        (void)RunCapture({"ip", "netns", "delete", name});
        dead.insert(pid);
      }
    }
  }
  for (int pid : dead) (void)RunCapture({"ip", "link", "delete", absl::StrCat(kPrefix, pid, "b")});
}

// A /24 under 10.213.0.0/16 that no interface of this namespace uses yet.
absl::StatusOr<int> FreeSubnet() {
  auto addrs = RunCapture({"ip", "-o", "-4", "addr", "show"});
  if (!addrs.ok()) return addrs.status();
  for (int k = 0; k < 250; ++k) {
    const int s = (getpid() + k) % 250;
    if (!absl::StrContains(addrs->second, absl::StrCat(" 10.213.", s, "."))) return s;
  }
  return absl::ResourceExhaustedError("no free 10.213.S.0/24 subnet for the fault suite's bridge");
}

}  // namespace

absl::Status RunCommand(const std::vector<std::string>& argv) {
  auto r = RunCapture(argv);
  if (!r.ok()) return r.status();
  if (r->first != 0) {
    return absl::InternalError(
        absl::StrCat("`", absl::StrJoin(argv, " "), "` exited ", r->first, ": ", r->second));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NetnsLab>> NetnsLab::Create(const std::vector<std::string>& names) {
  if (geteuid() != 0) {
    return absl::PermissionDeniedError(
        "the multi-host fault suite needs root (network namespaces, veth, tc, nft, iptables); run "
        "it as "
        "root -- CI does -- it does not skip");
  }
  for (const char* tool : {"ip", "tc", "nft", "iptables"}) {
    auto r = RunCapture({tool, std::string(tool) == "ip" || std::string(tool) == "tc" ? "-V"
                                                                                      : "--version"});
    if (!r.ok() || r->first == 127) {
      return absl::FailedPreconditionError(
          absl::StrCat("`", tool,
                       "` is missing: run tools/setup.sh (iproute2, nftables, iptables); the suite "
                       "does not skip"));
    }
  }
  RemoveLeftovers();
  std::unique_ptr<NetnsLab> lab(new NetnsLab());
  lab->prefix_ = absl::StrCat(kPrefix, getpid());
  auto subnet = FreeSubnet();
  if (!subnet.ok()) return subnet.status();
  lab->subnet_ = *subnet;
  lab->names_ = names;
  lab->created_.assign(names.size(), false);
  lab->delayers_.assign(names.size(), 0);
  const std::string bridge = lab->prefix_ + "b";
  if (absl::Status s = RunCommand({"ip", "link", "add", bridge, "type", "bridge"}); !s.ok()) {
    return s;
  }
  lab->bridge_created_ = true;
  for (const auto& cmd : std::vector<std::vector<std::string>>{
           {"ip", "addr", "add", lab->bridge_ip() + "/24", "dev", bridge},
           {"ip", "link", "set", bridge, "up"}}) {
    if (absl::Status s = RunCommand(cmd); !s.ok()) return s;
  }
  for (int i = 0; i < lab->hosts(); ++i) {
    const std::string ns = lab->netns(i);
    const std::string host_end = absl::StrCat(lab->prefix_, "v", i);
    const std::string ns_end = absl::StrCat(lab->prefix_, "p", i);
    if (absl::Status s = RunCommand({"ip", "netns", "add", ns}); !s.ok()) return s;
    lab->created_[i] = true;
    for (const auto& cmd : std::vector<std::vector<std::string>>{
             {"ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end},
             {"ip", "link", "set", ns_end, "netns", ns},
             {"ip", "-n", ns, "link", "set", ns_end, "name", "eth0"},
             {"ip", "-n", ns, "addr", "add", lab->ip(i) + "/24", "dev", "eth0"},
             {"ip", "-n", ns, "link", "set", "eth0", "up"},
             {"ip", "-n", ns, "link", "set", "lo", "up"},
             {"ip", "link", "set", host_end, "master", bridge},
             {"ip", "link", "set", host_end, "up"}}) {
      if (absl::Status s = RunCommand(cmd); !s.ok()) return s;
    }
  }
  return lab;
}

NetnsLab::~NetnsLab() {
  for (int i = 0; i < hosts(); ++i) StopDelayer(i);
  for (int i = 0; i < hosts(); ++i) {
    if (created_[i]) (void)RunCapture({"ip", "netns", "delete", netns(i)});
  }
  if (bridge_created_) (void)RunCapture({"ip", "link", "delete", prefix_ + "b"});
}

std::string NetnsLab::ip(int i) const { return absl::StrCat("10.213.", subnet_, ".", 10 + i); }
std::string NetnsLab::bridge_ip() const { return absl::StrCat("10.213.", subnet_, ".1"); }
std::string NetnsLab::netns(int i) const { return absl::StrCat(prefix_, "-", names_[i]); }

std::vector<std::string> NetnsLab::InHost(int i, std::vector<std::string> argv) const {
  std::vector<std::string> out = {"/usr/sbin/ip", "netns", "exec", netns(i)};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

absl::Status NetnsLab::LinkDown(int i) {
  return RunCommand({"ip", "link", "set", absl::StrCat(prefix_, "v", i), "down"});
}

absl::Status NetnsLab::LinkUp(int i) {
  return RunCommand({"ip", "link", "set", absl::StrCat(prefix_, "v", i), "up"});
}

absl::Status NetnsLab::RateLimit(int i, const std::string& rate) {
  return RunCommand({"tc", "-n", netns(i), "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                     rate, "burst", "64kb", "latency", "2s"});
}

absl::Status NetnsLab::Loss(int i, int percent) {
  const std::string ns = netns(i);
  // One table, two chains (what the host receives and what it sends), one random-drop rule each.
  std::string rules = absl::StrCat(
      "table inet fxloss {\n", "  chain in { type filter hook input priority 0; policy accept;\n",
      "    meta l4proto tcp numgen random mod 100 < ", percent, " counter drop\n  }\n",
      "  chain out { type filter hook output priority 0; policy accept;\n",
      "    meta l4proto tcp numgen random mod 100 < ", percent, " counter drop\n  }\n", "}\n");
  char tmpl[] = "/tmp/fluxion-netns-nft-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return absl::InternalError("mkstemp failed");
  if (write(fd, rules.data(), rules.size()) != static_cast<ssize_t>(rules.size())) {
    close(fd);
    unlink(tmpl);
    return absl::InternalError("short write of the nft rules");
  }
  close(fd);
  absl::Status s = RunCommand({"ip", "netns", "exec", ns, "nft", "-f", tmpl});
  unlink(tmpl);
  return s;
}

absl::StatusOr<int64_t> NetnsLab::DroppedPackets(int i) {
  auto r = RunCapture({"ip", "netns", "exec", netns(i), "nft", "list", "table", "inet", "fxloss"});
  if (!r.ok()) return r.status();
  if (r->first != 0) return absl::NotFoundError(absl::StrCat("no loss rules on ", netns(i)));
  int64_t total = 0;
  // "... counter packets 12 bytes 3456 drop", once per chain.
  for (absl::string_view rest = r->second;;) {
    const size_t at = rest.find("packets ");
    if (at == absl::string_view::npos) break;
    rest.remove_prefix(at + 8);
    int64_t n = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find(' ')), &n)) {
      return absl::DataLossError(absl::StrCat("unparseable nft counter: ", r->second));
    }
    total += n;
  }
  return total;
}

absl::Status NetnsLab::Delay(int i, int ms, const std::string& link_delay_binary) {
  if (delayers_[i] != 0) return absl::FailedPreconditionError("a delay is already on this host");
  const std::string ns = netns(i);
  const std::string ready = absl::StrCat("/tmp/fluxion-netns-delay-", ns, ".ready");
  const std::string log = absl::StrCat("/tmp/fluxion-netns-delay-", ns, ".log");
  unlink(ready.c_str());
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    const std::string delay = absl::StrCat(ms);
    execlp("ip", "ip", "netns", "exec", ns.c_str(), link_delay_binary.c_str(), "--queue",
           kDelayQueue, "--delay-ms", delay.c_str(), "--ready-file", ready.c_str(), nullptr);
    _exit(127);
  }
  delayers_[i] = pid;
  // Packets queued before the program reads the queue would be dropped: rules only once it has.
  bool exited = false;
  const bool bound = WaitFor(
      [&] {
        int status = 0;
        exited = waitpid(pid, &status, WNOHANG) == pid;
        return exited || access(ready.c_str(), F_OK) == 0;
      },
      kGenerousWait, absl::Milliseconds(50));
  if (!bound || exited) {
    if (!exited) StopDelayer(i);
    delayers_[i] = 0;
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    return absl::InternalError(absl::StrCat("link_delay did not start on ", ns, ": ", ss.str()));
  }
  unlink(ready.c_str());
  for (const char* chain : {"INPUT", "OUTPUT"}) {
    const char* dir = std::string(chain) == "INPUT" ? "-i" : "-o";
    if (absl::Status s = RunCommand({"ip", "netns", "exec", ns, "iptables", "-w", "-A", chain, dir,
                                     "eth0", "-j", "NFQUEUE", "--queue-num", kDelayQueue});
        !s.ok()) {
      (void)ClearShaping(i);
      return s;
    }
  }
  return absl::OkStatus();
}

void NetnsLab::StopDelayer(int i) {
  if (delayers_.empty() || delayers_[i] == 0) return;
  kill(delayers_[i], SIGTERM);  // it accepts what it still holds, then exits
  int status = 0;
  waitpid(delayers_[i], &status, 0);
  delayers_[i] = 0;
}

absl::Status NetnsLab::ClearShaping(int i) {
  const std::string ns = netns(i);
  // Any may be absent; what matters is that none is left. The queue's rules go before the program
  // that reads it: a queued packet with no reader is dropped.
  (void)RunCapture({"tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"});
  (void)RunCapture({"ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "fxloss"});
  (void)RunCapture({"ip", "netns", "exec", ns, "iptables", "-w", "-F", "INPUT"});
  (void)RunCapture({"ip", "netns", "exec", ns, "iptables", "-w", "-F", "OUTPUT"});
  StopDelayer(i);
  auto qdisc = RunCapture({"tc", "-n", ns, "qdisc", "show", "dev", "eth0"});
  auto nft = RunCapture({"ip", "netns", "exec", ns, "nft", "list", "ruleset"});
  auto ipt = RunCapture({"ip", "netns", "exec", ns, "iptables", "-w", "-S"});
  if (!qdisc.ok() || !nft.ok() || !ipt.ok()) {
    return absl::InternalError("cannot list qdiscs / nft / iptables rules");
  }
  if (absl::StrContains(qdisc->second, "tbf") || absl::StrContains(nft->second, "fxloss") ||
      absl::StrContains(ipt->second, "NFQUEUE")) {
    return absl::InternalError(
        absl::StrCat("shaping left on ", ns, ": ", qdisc->second, nft->second, ipt->second));
  }
  return absl::OkStatus();
}

}  // namespace fluxion::testing
