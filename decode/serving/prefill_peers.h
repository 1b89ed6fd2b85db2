// The prefill nodes a decode node trusts. A Prefill call hands the peer the arena's UCX worker
// address and remote key, i.e. the right to write into this node's KV memory, so the peer must
// come from the node's own configuration, never from a client: a request naming any other
// address in GenerateRequest.prefill_address is refused with PERMISSION_DENIED
// (docs/SECURITY.md).
//
// Trusted are the `--prefill-address` entries (exact "host:port" strings) and every IPv4 A record
// of the `--prefill-dns` names ("name:port", as "ip:port"), which is how a router that discovers
// prefill pods through a headless Service names them. DNS answers are cached; a miss re-resolves
// at most once per `min_resolve_interval`, so a new pod is trusted within about that long and a
// flood of untrusted addresses costs at most one lookup per interval.
//
// Thread-safe.
#ifndef FLUXION_DECODE_SERVING_PREFILL_PEERS_H_
#define FLUXION_DECODE_SERVING_PREFILL_PEERS_H_

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace fluxion::decode {

class PrefillPeers {
 public:
  struct Options {
    std::vector<std::string> addresses;  // "host:port", trusted as written
    std::vector<std::string> dns;        // "name:port", every A record trusted
    absl::Duration min_resolve_interval = absl::Seconds(1);
  };

  // INVALID_ARGUMENT naming the flag for an entry that is not host:port with a port in 1-65535.
  // Names that do not resolve yet are not an error (pods may not exist yet).
  static absl::StatusOr<std::unique_ptr<PrefillPeers>> Create(Options options);

  // The node for a request that names none: the `addresses` in turn, else the resolved DNS
  // addresses in turn. FAILED_PRECONDITION when none is configured or resolvable.
  absl::StatusOr<std::string> Pick();

  // OK when `address` is trusted; PERMISSION_DENIED naming the flags otherwise.
  absl::Status Check(const std::string& address);

 private:
  explicit PrefillPeers(Options options) : options_(std::move(options)) {}
  // Re-resolves the DNS names if the last lookup is older than min_resolve_interval (or `force`).
  void MaybeResolve(bool force) ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  absl::Mutex mu_;
  std::vector<std::string> resolved_ ABSL_GUARDED_BY(mu_);  // "ip:port" of the DNS names
  absl::Time last_resolve_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_PREFILL_PEERS_H_
