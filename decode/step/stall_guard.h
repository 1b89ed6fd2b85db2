// Dynamic degradation of the hybrid step (docs/ALGORITHMS.md §2.4.6, item 3): when the
// CPU's part of a step takes longer than the device's by more than a slack, the next step's
// sparse policies spend a smaller share of their middle budget, so the CPU stops stalling the
// GPU; when the CPU is early again the share recovers. Opt-in (`fluxion decode
// --degrade-on-stall`), because it trades attention quality for time per token: a user who asked
// for budget 0.05 gets 0.05 unless they allow this.
//
// The rule, per step, from the step's own phase times (HybridCounters):
//   cpu = plan + host attention + finish (the CPU phase the device waits for),
//   gpu = to_host + merge (the time the CPU waited for the device: its dense work between CPU
//         phases, the part of the step the CPU cannot shorten);
//   cpu > (1 + slack) gpu:  scale *= (1 + slack) gpu / cpu   (the CPU phase is ~linear in the
//                            rows it reads, so this is the scale that would just meet the slack),
//                            floored at min_scale;
//   cpu < gpu:              scale *= min(recovery, gpu / cpu), capped at 1.
// All heads are scaled alike: ALGORITHMS.md suggests degrading the "cheapest retrieval heads"
// first, but the fixed policies' heads are all alike and Fluxion's per-head budgets already encode
// which heads matter, so a uniform scale keeps its proportions. [ENG]
//
// Thread-compatible: the executor's thread updates it once per step.
#ifndef FLUXION_DECODE_STEP_STALL_GUARD_H_
#define FLUXION_DECODE_STEP_STALL_GUARD_H_

#include <cstdint>

#include "absl/status/status.h"

namespace fluxion::decode {

struct StallGuardOptions {
  bool enabled = false;
  double slack = 0.2;      // δ: the CPU may take this much longer than the device [ENG]
  double min_scale = 0.4;  // the floor: 0.05 -> 0.02 of the middle, never less [ENG]
  double recovery = 1.25;  // the most the scale grows per step [ENG]
};

// InvalidArgument naming the field for slack < 0, min_scale outside (0, 1], recovery < 1.
absl::Status ValidateStallGuardOptions(const StallGuardOptions& options);

class StallGuard {
 public:
  // REQUIRES: ValidateStallGuardOptions(options).ok().
  explicit StallGuard(const StallGuardOptions& options) : options_(options) {}

  // The share of every policy's middle budget the next step may spend (1 when disabled).
  double scale() const { return scale_; }
  // After a step whose CPU phase took `cpu_s` and whose waits for the device took `gpu_s`.
  // Steps with no CPU work (every plan resident) leave the scale as it is.
  void Observe(double cpu_s, double gpu_s);

  int64_t degraded_steps() const { return degraded_steps_; }  // steps run at a scale below 1

 private:
  StallGuardOptions options_;
  double scale_ = 1.0;
  int64_t degraded_steps_ = 0;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_STALL_GUARD_H_
