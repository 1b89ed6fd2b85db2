#include "decode/serving/prefill_peers.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fluxion::decode {
namespace {

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address,
                                                          const char* flag) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", address, "' is not host:port (e.g. prefill-0:7001)"));
  }
  return std::make_pair(address.substr(0, colon), port);
}

// Every IPv4 address of `host` as "ip:port"; empty when it does not resolve (yet).
std::vector<std::string> ResolveIpv4(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &result) != 0) return {};
  std::vector<std::string> out;
  for (addrinfo* a = result; a != nullptr; a = a->ai_next) {
    char ip[INET_ADDRSTRLEN];
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, ip, sizeof(ip)) != nullptr) {
      out.push_back(absl::StrCat(ip, ":", port));
    }
  }
  freeaddrinfo(result);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillPeers>> PrefillPeers::Create(Options options) {
  for (const std::string& a : options.addresses) {
    absl::StatusOr<std::pair<std::string, int>> split = SplitHostPort(a, "--prefill-address");
    if (!split.ok()) return split.status();
  }
  for (const std::string& d : options.dns) {
    absl::StatusOr<std::pair<std::string, int>> split = SplitHostPort(d, "--prefill-dns");
    if (!split.ok()) return split.status();
  }
  std::unique_ptr<PrefillPeers> peers(new PrefillPeers(std::move(options)));
  peers->MaybeResolve(/*force=*/true);
  return peers;
}

void PrefillPeers::MaybeResolve(bool force) {
  if (options_.dns.empty()) return;
  {
    absl::MutexLock lock(&mu_);
    if (!force && absl::Now() - last_resolve_ < options_.min_resolve_interval) return;
    last_resolve_ = absl::Now();  // claimed: concurrent misses do not resolve again
  }
  std::vector<std::string> all;
  for (const std::string& d : options_.dns) {
    auto split = SplitHostPort(d, "--prefill-dns");  // validated in Create
    if (!split.ok()) continue;
    for (std::string& a : ResolveIpv4(split->first, split->second)) all.push_back(std::move(a));
  }
  absl::MutexLock lock(&mu_);
  // A failed lookup keeps the old set, as the router does: a DNS hiccup must not stop serving.
  if (!all.empty()) resolved_ = std::move(all);
}

absl::StatusOr<std::string> PrefillPeers::Pick() {
  if (!options_.addresses.empty()) {
    absl::MutexLock lock(&mu_);
    return options_.addresses[next_++ % options_.addresses.size()];
  }
  MaybeResolve(/*force=*/false);
  absl::MutexLock lock(&mu_);
  if (resolved_.empty()) {
    return absl::FailedPreconditionError(
        options_.dns.empty()
            ? "no prefill node: start the decode node with --prefill-address (or --prefill-dns)"
            : absl::StrCat("no prefill node: --prefill-dns ", absl::StrJoin(options_.dns, ","),
                           " resolves to no address yet"));
  }
  return resolved_[next_++ % resolved_.size()];
}

absl::Status PrefillPeers::Check(const std::string& address) {
  for (const std::string& a : options_.addresses) {
    if (a == address) return absl::OkStatus();
  }
  auto known = [&] {
    absl::MutexLock lock(&mu_);
    return std::find(resolved_.begin(), resolved_.end(), address) != resolved_.end();
  };
  if (known()) return absl::OkStatus();
  MaybeResolve(/*force=*/false);  // a prefill pod started since the last lookup
  if (known()) return absl::OkStatus();
  // The address is the client's: cap what is echoed back.
  const std::string shown =
      address.size() > 256 ? absl::StrCat(address.substr(0, 256), "...") : address;
  return absl::PermissionDeniedError(absl::StrCat(
      "prefill_address '", shown,
      "' is not a prefill node this decode node trusts; it sends KV targets (its arena's worker "
      "address and remote key) only to the nodes of its --prefill-address list or the A records "
      "of its --prefill-dns names (docs/SECURITY.md)"));
}

}  // namespace fluxion::decode
