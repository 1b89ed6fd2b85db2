// Whether the router routes to a node, from the run of its health checks: a node is dropped only
// after `failures_to_eject` checks in a row failed, and an ejected node is taken back only after
// `successes_to_admit` checks in a row passed. One missed check on a loaded box (a health answer
// later than its deadline) no longer ejects a node that is serving (docs/FAULTS.md, "Soak"), and a
// node whose link flaps is not taken back on its first good answer.
//
// A node never seen healthy (just started, or just found in DNS) joins on its first passing
// check: there is no history to distrust, and a cluster coming up should not wait M polls.
// A failure the request path saw (an attempt got UNAVAILABLE without any message: the node could
// not be reached at all) ejects at once; that is a connection failure, not a late answer.
//
// A plain value type: not thread-safe, the owner (Backends) guards it with its mutex.
#ifndef FLUXION_CLUSTER_BACKEND_HEALTH_H_
#define FLUXION_CLUSTER_BACKEND_HEALTH_H_

#include <cstdint>

#include "absl/status/status.h"

namespace fluxion::cluster {

struct HealthHysteresisOptions {
  int failures_to_eject = 3;   // N: consecutive failed checks that drop a healthy node
  int successes_to_admit = 2;  // M: consecutive passed checks that take an ejected node back
};

// INVALID_ARGUMENT unless both counts are in [1, 100].
absl::Status ValidateHealthHysteresis(const HealthHysteresisOptions& options);

// kNew: never passed a check. kHealthy: routed to, last check passed. kSuspect: routed to, but
// the last 1..N-1 checks failed. kEjected: not routed to, last check failed. kRecovering: not
// routed to, the last 1..M-1 checks passed.
enum class HealthState { kNew, kHealthy, kSuspect, kEjected, kRecovering };
inline constexpr HealthState kAllHealthStates[] = {HealthState::kNew, HealthState::kHealthy,
                                                   HealthState::kSuspect, HealthState::kEjected,
                                                   HealthState::kRecovering};
// "new", "healthy", "suspect", "ejected", "recovering" (the `state` label of the metric).
const char* HealthStateName(HealthState state);

class HealthHysteresis {
 public:
  explicit HealthHysteresis(HealthHysteresisOptions options = {}) : options_(options) {}

  // One health-check round's verdict for the node.
  void Observe(bool passed);
  // The request path could not reach the node at all: ejected now.
  void Eject();

  HealthState state() const { return state_; }
  // Whether the router may send the node work (kHealthy or kSuspect).
  bool routable() const {
    return state_ == HealthState::kHealthy || state_ == HealthState::kSuspect;
  }
  int consecutive_failures() const { return failures_; }
  int consecutive_successes() const { return successes_; }
  // Times the node went from routable to ejected.
  int64_t ejections() const { return ejections_; }

 private:
  HealthHysteresisOptions options_;
  HealthState state_ = HealthState::kNew;
  int failures_ = 0;
  int successes_ = 0;
  int64_t ejections_ = 0;
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_BACKEND_HEALTH_H_
