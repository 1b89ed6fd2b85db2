// Separate network hosts on one machine for the multi-host fault suite: one Linux network namespace
// per host, each joined to a bridge in the test's own namespace by a veth pair (iproute2), so every
// host has its own eth0, IPv4 address, loopback and ports, and the test process reaches all of
// them through the bridge. Faults are applied to the links: down/up (either end), a rate limit (tc
// tbf), random loss (nftables numgen rules inside the host's namespace), added delay (iptables
// NFQUEUE rules handing the host's packets to tests/link_delay, which holds each for a fixed time:
// this kernel has no tc netem, docs/FAULTS.md).
//
// Needs root (CAP_NET_ADMIN) and the `ip`, `tc`, `nft` and `iptables` commands (tools/setup.sh
// installs iproute2, nftables and iptables). Create() fails -- it never skips -- when any of that
// is missing.
//
// Thread-compatible: one owner.
#ifndef FLUXION_TESTS_NETNS_LAB_H_
#define FLUXION_TESTS_NETNS_LAB_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fluxion::testing {

// Runs argv (argv[0] looked up in PATH) and waits; INTERNAL with the command and its output when it
// does not exit 0.
absl::Status RunCommand(const std::vector<std::string>& argv);

class NetnsLab {
 public:
  // `hosts` namespaces named "<prefix>-<name>" for each of `names`, on a fresh /24. Removes what
  // an earlier, killed run of this suite left behind (namespaces and bridges of dead pids).
  static absl::StatusOr<std::unique_ptr<NetnsLab>> Create(const std::vector<std::string>& names);
  // Stops the delay programs, deletes the namespaces (and with them their veth pairs) and the
  // bridge.
  ~NetnsLab();
  NetnsLab(const NetnsLab&) = delete;
  NetnsLab& operator=(const NetnsLab&) = delete;

  int hosts() const { return static_cast<int>(names_.size()); }
  const std::string& host_name(int i) const { return names_[i]; }
  // The host's IPv4 address on the bridge ("10.213.S.(10+i)").
  std::string ip(int i) const;
  std::string bridge_ip() const;
  std::string netns(int i) const;
  // argv prefixed with `ip netns exec <ns>`: the process execs in the host's namespace (same pid).
  std::vector<std::string> InHost(int i, std::vector<std::string> argv) const;

  // The host's link, at the bridge end (the host keeps its own eth0 up but loses carrier).
  absl::Status LinkDown(int i);
  absl::Status LinkUp(int i);
  // Token-bucket rate limit on what the host sends (its eth0 egress), e.g. "20mbit".
  absl::Status RateLimit(int i, const std::string& rate);
  // Drops `percent` % of TCP packets the host sends and receives, at random (nft numgen).
  absl::Status Loss(int i, int percent);
  // Packets the Loss() rules dropped so far (both directions).
  absl::StatusOr<int64_t> DroppedPackets(int i);
  // Adds `ms` of latency to every packet the host sends and receives on eth0 (so a round trip
  // through it gains 2 x ms): starts `link_delay_binary` (tests/link_delay) in the host's namespace
  // and, once it has bound its queue, the iptables rules that hand it the packets.
  absl::Status Delay(int i, int ms, const std::string& link_delay_binary);
  // Removes the rate limit, loss and delay rules (and stops the delay program).
  absl::Status ClearShaping(int i);

 private:
  NetnsLab() = default;
  void StopDelayer(int i);
  std::string prefix_;  // "fxf<pid>"
  int subnet_ = 0;      // the S of 10.213.S.0/24
  std::vector<std::string> names_;
  std::vector<bool> created_;
  std::vector<int> delayers_;  // pid of each host's link_delay, 0 for none; owned: stopped here
  bool bridge_created_ = false;
};

}  // namespace fluxion::testing

#endif  // FLUXION_TESTS_NETNS_LAB_H_
