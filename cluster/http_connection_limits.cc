#include "cluster/http_connection_limits.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/metrics_names.h"

namespace fluxion::cluster {
namespace {

constexpr absl::Duration kLogInterval = absl::Seconds(10);
constexpr char kRefusedHelp[] =
    "HTTP API connections closed at accept: over --http-max-connections-per-client from one "
    "address (per_client) or over --http-max-connections in all (total).";

}  // namespace

ConnectionLimiter::ConnectionLimiter(ConnectionLimits limits, metrics::Registry* registry,
                                     std::function<void(const std::string&)> log,
                                     std::function<absl::Time()> now)
    : limits_(limits),
      refused_per_client_(registry->AddCounter(metrics::names::kRouterHttpConnectionsRefusedTotal,
                                               kRefusedHelp, {{"reason", "per_client"}})),
      refused_total_(registry->AddCounter(metrics::names::kRouterHttpConnectionsRefusedTotal,
                                          kRefusedHelp, {{"reason", "total"}})),
      log_(std::move(log)),
      now_(std::move(now)) {}

bool ConnectionLimiter::Admit(const std::string& client) {
  absl::MutexLock lock(&mu_);
  if (open_ >= limits_.total) {
    Refused(client, /*per_client=*/false);
    return false;
  }
  if (limits_.per_client > 0) {
    auto it = by_client_.find(client);
    if (it != by_client_.end() && it->second >= limits_.per_client) {
      Refused(client, /*per_client=*/true);
      return false;
    }
  }
  return true;
}

void ConnectionLimiter::Opened(const std::string& client) {
  absl::MutexLock lock(&mu_);
  ++open_;
  ++by_client_[client];
}

void ConnectionLimiter::Closed(const std::string& client) {
  absl::MutexLock lock(&mu_);
  if (open_ > 0) --open_;
  auto it = by_client_.find(client);
  if (it == by_client_.end()) return;
  if (--it->second == 0) by_client_.erase(it);
}

void ConnectionLimiter::Refused(const std::string& client, bool per_client) {
  (per_client ? refused_per_client_ : refused_total_)->Increment();
  ++(per_client ? unlogged_per_client_ : unlogged_total_);
  const absl::Time now = now_();
  if (now < next_log_) return;
  next_log_ = now + kLogInterval;
  log_(absl::StrCat("router: http: refusing connections: ", unlogged_per_client_,
                    " over the per-client limit (--http-max-connections-per-client ",
                    limits_.per_client, "), ", unlogged_total_,
                    " over the total limit (--http-max-connections ", limits_.total,
                    ") since the last such line; latest from ", client.empty() ? "?" : client, " (",
                    open_, " connections open)"));
  unlogged_per_client_ = 0;
  unlogged_total_ = 0;
}

std::string ConnectionLimiter::ClientKey(const sockaddr* addr) {
  char text[INET6_ADDRSTRLEN] = {0};
  if (addr == nullptr) return "";
  if (addr->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, text, sizeof(text));
  } else if (addr->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, text,
              sizeof(text));
  }
  return text;
}

}  // namespace fluxion::cluster
