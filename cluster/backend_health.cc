#include "cluster/backend_health.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::cluster {

absl::Status ValidateHealthHysteresis(const HealthHysteresisOptions& options) {
  const std::pair<const char*, int> counts[] = {{"--health-failures", options.failures_to_eject},
                                                {"--health-successes", options.successes_to_admit}};
  for (const auto& [name, value] : counts) {
    if (value < 1 || value > 100) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " is ", value, "; give a count of consecutive health checks in [1, 100]"));
    }
  }
  return absl::OkStatus();
}

const char* HealthStateName(HealthState state) {
  switch (state) {
    case HealthState::kNew: return "new";
    case HealthState::kHealthy: return "healthy";
    case HealthState::kSuspect: return "suspect";
    case HealthState::kEjected: return "ejected";
    case HealthState::kRecovering: return "recovering";
  }
  return "unknown";
}

void HealthHysteresis::Observe(bool passed) {
  if (passed) {
    failures_ = 0;
    ++successes_;
    switch (state_) {
      case HealthState::kNew:
      case HealthState::kHealthy:
      case HealthState::kSuspect:
        state_ = HealthState::kHealthy;
        break;
      case HealthState::kEjected:
      case HealthState::kRecovering:
        state_ = successes_ >= options_.successes_to_admit ? HealthState::kHealthy
                                                           : HealthState::kRecovering;
        break;
    }
    return;
  }
  successes_ = 0;
  ++failures_;
  switch (state_) {
    case HealthState::kNew:
      break;  // stays not routable until its first pass
    case HealthState::kHealthy:
    case HealthState::kSuspect:
      if (failures_ >= options_.failures_to_eject) {
        state_ = HealthState::kEjected;
        ++ejections_;
      } else {
        state_ = HealthState::kSuspect;
      }
      break;
    case HealthState::kEjected:
    case HealthState::kRecovering:
      state_ = HealthState::kEjected;
      break;
  }
}

void HealthHysteresis::Eject() {
  successes_ = 0;
  ++failures_;
  if (routable()) ++ejections_;
  if (state_ != HealthState::kNew) state_ = HealthState::kEjected;
}

}  // namespace fluxion::cluster
