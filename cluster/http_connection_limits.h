// How many HTTP connections the API holds, in all and per client address, so that idle or slow
// connections from one client cannot take every slot and lock everyone else out (/health
// included). libmicrohttpd asks Admit in its accept policy and reports each accepted connection's
// start and end (Opened, Closed), all on its one polling thread. A refused connection is closed at
// once; each refusal is counted in fluxion_router_http_connections_refused_total{reason} and
// logged, at most one line per 10 s.
//
// Thread-safe.
#ifndef FLUXION_CLUSTER_HTTP_CONNECTION_LIMITS_H_
#define FLUXION_CLUSTER_HTTP_CONNECTION_LIMITS_H_

#include <sys/socket.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"

namespace fluxion::cluster {

struct ConnectionLimits {
  unsigned int total = 1024;
  unsigned int per_client = 256;  // 0: no per-client limit
};

class ConnectionLimiter {
 public:
  // `log` gets each rate-limited line (stderr in the router); `now` is the clock (tests).
  ConnectionLimiter(ConnectionLimits limits, metrics::Registry* registry,
                    std::function<void(const std::string&)> log,
                    std::function<absl::Time()> now = absl::Now);

  // Whether a new connection from `client` (ClientKey) may be accepted now.
  bool Admit(const std::string& client);
  // An admitted connection started / ended.
  void Opened(const std::string& client);
  void Closed(const std::string& client);

  // The address part of `addr` (IPv4 or IPv6), printable ("127.0.0.2"); "" for other families.
  static std::string ClientKey(const sockaddr* addr);

 private:
  void Refused(const std::string& client, bool per_client) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ConnectionLimits limits_;
  metrics::Counter* const refused_per_client_;
  metrics::Counter* const refused_total_;
  const std::function<void(const std::string&)> log_;
  const std::function<absl::Time()> now_;
  absl::Mutex mu_;
  unsigned int open_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, unsigned int> by_client_ ABSL_GUARDED_BY(mu_);
  // Refusals since the last log line, and when the next line may go out.
  uint64_t unlogged_per_client_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t unlogged_total_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time next_log_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_HTTP_CONNECTION_LIMITS_H_
