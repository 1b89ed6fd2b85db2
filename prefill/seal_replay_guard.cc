#include "prefill/seal_replay_guard.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace fluxion::prefill {

absl::Status SealReplayGuard::Admit(const fluxion::v1::PrefillSeal& seal, absl::Time now) {
  const absl::Time expires = absl::FromUnixMillis(
      static_cast<int64_t>(std::min<uint64_t>(seal.expires_unix_ms(), INT64_MAX)));
  absl::MutexLock lock(&mu_);
  while (!by_expiry_.empty() && by_expiry_.top().first < now) {
    macs_.erase(by_expiry_.top().second);
    by_expiry_.pop();
  }
  if (macs_.contains(seal.mac())) {
    return absl::PermissionDeniedError(
        "this sealed prefill request was already received once: a replay (decode nodes send each "
        "attempt with a fresh id and seal)");
  }
  if (macs_.size() >= max_live_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the prefill node holds ", macs_.size(),
        " unexpired prefill seals, its limit; retry once some expire"));
  }
  macs_.insert(seal.mac());
  by_expiry_.emplace(expires, seal.mac());
  return absl::OkStatus();
}

size_t SealReplayGuard::live() const {
  absl::MutexLock lock(&mu_);
  return macs_.size();
}

}  // namespace fluxion::prefill
