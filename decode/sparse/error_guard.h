// The online per-head error guard (issue 18): a request's sparse budget follows the error each
// head actually makes, measured during decoding instead of predicted before it.
//
// Every decode step a small rotating sample of (layer, KV head) pairs is also attended exactly,
// over every row, and the step's sparse output of the head is compared with the exact one after
// the head's slice of the output projection: e_h = ||W_O^h (o_h - ô_h)|| / ||W_O o|| (the error
// Fluxion budgets by, ALGORITHMS.md §2.4.2; model/output_projection.h computes it, the offline
// head table uses the same code). The result feeds back into the head's budget:
//   - e_h > tolerance: the head's weight grows to max(grow x w, w + 1) (capped at max_weight),
//     an "escalation";
//   - e_h < relax_ratio x tolerance at `hold` checks in a row: it shrinks to shrink x w, a
//     "relaxation". `hold` is 1 for a head never escalated and doubles (up to 64) at each
//     escalation: a head whose need was just met shows a small error at its new budget, and
//     giving that budget straight back would make it fail again (an escalate / relax cycle on a
//     head whose need sits between two steps); backing off keeps it at a budget that works and
//     still lets it give back once its need is gone for longer;
// An escalation must pay off: at the head's next check, an error still above tolerance and not
// below kFutileRatio of the one that escalated it means the extra rows bought nothing (a diffuse
// head whose error no budget within reach fixes); the escalation is reverted (the weight goes
// back, to every other head in proportion) and the head may not escalate for kCooldownChecks
// checks. Without this, insatiable heads collect the request's budget up to max_weight each and
// starve the heads the budget helps (calibration, docs/SPARSE.md).
// where a weight is in units of the uniform middle budget (what a uniform policy at the same
// budget reads of the middle: LFPS's per-head budget, Fluxion's weight 1). Every change is paid
// for by (or returned to) the other heads of the request, so the sum of the weights, and with it
// the request's total middle read, stays what the policy was configured to spend (up to each
// head's rounding to whole rows). An escalation takes first from the heads last measured below
// the relaxation line, then from the heads not measured or within tolerance, and from heads above
// tolerance only when nothing else is left; a relaxation gives to the heads last measured above
// tolerance, or, when there is none, to every other head, each in proportion to its weight.
//
// The policy applies the guard's view as SelectionInput::budget_shift (the head's guarded weight
// minus the policy's own, policy.h). At a degenerate point (sinks + window cover the budget: no
// middle row at all) the uniform middle budget is 0 and the guard can move nothing.
//
// The exact checks read every row of the checked heads; they count in the budget spent and are
// reported separately (GuardStats::check_rows).
//
// Thread-compatible: one request. Shift() may be called concurrently with itself (the step's
// units select in parallel); BeginStep, Due and Report run between the selections of a step.
#ifndef FLUXION_DECODE_SPARSE_ERROR_GUARD_H_
#define FLUXION_DECODE_SPARSE_ERROR_GUARD_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fluxion::decode::sparse {

struct GuardConfig {
  bool enabled = false;
  // The share of the request's (layer, KV head) pairs checked exactly per decode step, in (0, 1]:
  // 24 pairs (the tiny model) at 1/24 check one pair a step, each pair every 24 steps.
  double sample_rate = 1.0 / 24;
  // Calibrated on calibration seeds (docs/SPARSE.md, "The online per-head error guard"): 4K,
  // aggregate / passage / niah_multivalue / niah_multikey, fluxion at 0.02 and 0.05, paired
  // against no guard: tolerance 0.1, max weight 8, rate 1/6 lost 38 of 48 (6 prompts per task;
  // budget piled onto heads no budget fixes), and over 32 pairs (4 prompts per task, rate 1/24
  // unless said): 0.5 / max 4 lost 5, 0.5 / max 2 lost 3 and gained 1, 0.5 / max 2 at rate 1/6
  // lost 5 and gained 1, 0.8 / max 2 neither lost nor gained. On this model e_h at these budgets
  // has median 0.1-0.2 and p90 0.4-0.6 over all heads, so only outliers above 0.8 move. [ENG]
  double tolerance = 0.8;     // e_h above it: escalate
  double relax_ratio = 0.25;  // e_h below relax_ratio x tolerance: relax
  double grow = 2.0;          // an escalation's weight factor (and at least +1)
  double shrink = 0.75;       // a relaxation's weight factor
  double max_weight = 2.0;    // no head holds more than this many uniform shares
};

// InvalidArgument naming the flag (--guard-rate, --guard-tolerance, ...) for a value out of range.
absl::Status ValidateGuard(const GuardConfig& c);

// What the guard did over a request.
struct GuardStats {
  int64_t checks = 0;        // (step, layer, KV head) exact checks
  int64_t check_rows = 0;    // K/V rows the exact checks read
  int64_t escalations = 0;   // checks that grew a head's budget
  int64_t relaxations = 0;   // checks that shrank one
  int64_t reverts = 0;       // escalations undone because they bought no smaller error
  std::vector<double> errors;  // e_h of every check, in order

  void Add(const GuardStats& o) {
    checks += o.checks;
    check_rows += o.check_rows;
    escalations += o.escalations;
    relaxations += o.relaxations;
    reverts += o.reverts;
    errors.insert(errors.end(), o.errors.begin(), o.errors.end());
  }
};

class ErrorGuard {
 public:
  // `base_weight(layer, kv_head)`: the policy's own weight of the head (1 for LFPS, Fluxion's
  // allocation); asked once per pair, at the first step. REQUIRES: ValidateGuard(config) is OK.
  ErrorGuard(const GuardConfig& config, int num_layers, int num_kv_heads,
             std::function<double(int layer, int kv_head)> base_weight);

  // Starts a decode step: chooses its checked pairs (the next ones in rotation).
  void BeginStep();
  // Whether (layer, kv_head) is checked this step.
  bool Due(int layer, int kv_head) const;
  // The head's guarded weight minus the policy's own (SelectionInput::budget_shift), as of the
  // start of this step; 0 before the first step. A step's checks move weights for the next step
  // only: applied at once, a move from a layer already attended to one not yet attended would be
  // spent twice in this step (a relaxation's budget given to later layers while the relaxing head
  // had spent its share; the request over-read by 1-2.5% in `fluxion generate`).
  double Shift(int layer, int kv_head) const;
  // The check of a due pair: its e_h and the rows the exact attention read.
  void Report(int layer, int kv_head, double error, int64_t rows_read);

  double Weight(int layer, int kv_head) const;  // the guarded weight (tests, reports)
  double TotalWeight() const;
  const GuardStats& stats() const { return stats_; }
  const GuardConfig& config() const { return config_; }

 private:
  int Pair(int layer, int kv_head) const { return layer * num_kv_heads_ + kv_head; }
  static constexpr double kFutileRatio = 0.8;
  static constexpr int kCooldownChecks = 8;
  // Moves `delta` weight onto pair p (negative: off it) from / to the others, tier by tier; a
  // negative delta goes to the heads short of budget first unless `evenly`.
  void Rebalance(int p, double delta, bool evenly = false);

  const GuardConfig config_;
  const int num_layers_, num_kv_heads_, pairs_;
  std::function<double(int, int)> base_weight_;
  bool initialised_ = false;
  std::vector<double> base_, weight_;  // [pair]
  std::vector<double> step_weight_;    // [pair]: weight_ at BeginStep, what Shift applies
  std::vector<double> last_error_;     // [pair], < 0: never checked
  std::vector<int> low_streak_, hold_;  // [pair]: checks in a row below the relax line, needed
  // [pair]: the weight before the last escalation and the error that caused it (pending until
  // the next check judges it; from < 0: none), and checks left without escalation.
  std::vector<double> escalated_from_, escalated_error_;
  std::vector<int> cooldown_;
  std::vector<char> due_;              // [pair], this step
  int64_t cursor_ = 0;                 // the next pair in rotation
  double credit_ = 0;                  // fractional checks carried to the next step
  GuardStats stats_;
};

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_ERROR_GUARD_H_
