#include "decode/step/stall_guard.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fluxion::decode {

absl::Status ValidateStallGuardOptions(const StallGuardOptions& o) {
  if (!(o.slack >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("stall guard slack must be >= 0, got ", o.slack));
  }
  if (!(o.min_scale > 0 && o.min_scale <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("stall guard min_scale must be in (0, 1], got ", o.min_scale));
  }
  if (!(o.recovery >= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("stall guard recovery must be >= 1, got ", o.recovery));
  }
  return absl::OkStatus();
}

void StallGuard::Observe(double cpu_s, double gpu_s) {
  if (!options_.enabled) return;
  if (scale_ < 1.0) ++degraded_steps_;  // the step just observed ran degraded
  if (!(cpu_s > 0)) return;
  const double gpu = std::max(gpu_s, 1e-9);
  if (cpu_s > (1 + options_.slack) * gpu) {
    scale_ = std::max(options_.min_scale, scale_ * (1 + options_.slack) * gpu / cpu_s);
  } else if (cpu_s < gpu) {
    scale_ = std::min(1.0, scale_ * std::min(options_.recovery, gpu / cpu_s));
  }
}

}  // namespace fluxion::decode
