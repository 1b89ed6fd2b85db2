#include "decode/sparse/guard_flags.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::decode::sparse {

GuardFlags::GuardFlags(FlagSet& flags, bool allow_both) : allow_both_(allow_both) {
  flags.String("guard", &mode_,
               absl::StrCat("online per-head error guard for lfps / fluxion (exact checks of a "
                            "rotating sample of heads move budget between them): off, on",
                            allow_both ? ", both (each guardable policy with and without)" : ""));
  flags.Double("guard-rate", &config_.sample_rate,
               "share of (layer, KV head) pairs the guard checks exactly per decode step, (0, 1]");
  flags.Double("guard-tolerance", &config_.tolerance,
               "guard: a head whose output error e_h (after W_O) exceeds this gets more budget");
  flags.Double("guard-relax", &config_.relax_ratio,
               "guard: a head below this share of the tolerance gives budget back, [0, 1) "
               "(fluxion only: lfps heads never give budget back, docs/SPARSE.md)");
  flags.Double("guard-grow", &config_.grow, "guard: weight factor of an escalation, (1, 16]");
  flags.Double("guard-shrink", &config_.shrink, "guard: weight factor of a relaxation, (0, 1)");
  flags.Double("guard-max-weight", &config_.max_weight,
               "guard: most uniform middle budgets one head may hold, [1, 1024]");
}

absl::StatusOr<std::vector<bool>> GuardFlags::Modes() const {
  if (mode_ == "off") return std::vector<bool>{false};
  if (mode_ == "on") return std::vector<bool>{true};
  if (mode_ == "both" && allow_both_) return std::vector<bool>{false, true};
  return absl::InvalidArgumentError(absl::StrCat("--guard must be off or on",
                                                 allow_both_ ? " or both" : "", ", got '", mode_,
                                                 "'"));
}

absl::StatusOr<GuardConfig> GuardFlags::Config() const {
  absl::Status s = ValidateGuard(config_);
  if (!s.ok()) return s;
  return config_;
}

absl::StatusOr<GuardFlags::Parsed> GuardFlags::Read() const {
  absl::StatusOr<std::vector<bool>> modes = Modes();
  if (!modes.ok()) return modes.status();
  absl::StatusOr<GuardConfig> config = Config();
  if (!config.ok()) return config.status();
  return Parsed{*std::move(modes), *std::move(config)};
}

PolicyConfig WithGuard(PolicyConfig config, bool on, const GuardConfig& guard,
                       std::shared_ptr<const model::OutputProjection> projection) {
  if (!on || !TraitsOf(config.kind).guardable) return config;
  config.guard = guard;
  config.guard.enabled = true;
  config.output_projection = std::move(projection);
  return config;
}

std::vector<PolicyConfig> ExpandGuard(const std::vector<PolicyConfig>& configs,
                                      const std::vector<bool>& modes, const GuardConfig& guard,
                                      std::shared_ptr<const model::OutputProjection> projection) {
  std::vector<PolicyConfig> out;
  for (const PolicyConfig& c : configs) {
    if (!TraitsOf(c.kind).guardable) {
      out.push_back(c);
      continue;
    }
    for (bool on : modes) out.push_back(WithGuard(c, on, guard, projection));
  }
  return out;
}

}  // namespace fluxion::decode::sparse
