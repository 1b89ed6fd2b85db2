// Each sealed prefill request is acted on at most once (docs/SECURITY.md, "Sealed prefill
// requests"): a seal proves who made a request, not that this is its first delivery, and a
// captured request replayed while its seal is valid would write the same pages again, after their
// reservation may have gone to another request. The guard remembers every seal it admitted until
// the seal expires (at most proto::kMaxSealLifetime), by its MAC.
//
// Thread-safe.
#ifndef FLUXION_PREFILL_SEAL_REPLAY_GUARD_H_
#define FLUXION_PREFILL_SEAL_REPLAY_GUARD_H_

#include <cstddef>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fluxion/v1/prefill.pb.h"

namespace fluxion::prefill {

class SealReplayGuard {
 public:
  // About 100 bytes a seal: the default bounds the guard near 100 MiB, far above what a node
  // admits within one kMaxSealLifetime (a request a millisecond for an hour is 3.6 million).
  static constexpr size_t kDefaultMaxLive = size_t{1} << 20;
  explicit SealReplayGuard(size_t max_live = kDefaultMaxLive) : max_live_(max_live) {}

  // OK the first time `seal` (a checked one: proto::CheckPrefillSeal) is seen. PermissionDenied
  // when it was admitted before; ResourceExhausted ("retry later") when max_live unexpired seals
  // are held. Forgets seals whose expiry passed.
  absl::Status Admit(const fluxion::v1::PrefillSeal& seal, absl::Time now);

  size_t live() const;

 private:
  using Entry = std::pair<absl::Time, std::string>;  // expiry, MAC
  const size_t max_live_;
  mutable absl::Mutex mu_;
  absl::flat_hash_set<std::string> macs_ ABSL_GUARDED_BY(mu_);
  // Soonest expiry on top, so forgetting costs O(log n) a seal.
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> by_expiry_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_SEAL_REPLAY_GUARD_H_
