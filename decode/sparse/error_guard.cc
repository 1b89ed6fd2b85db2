#include "decode/sparse/error_guard.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fluxion::decode::sparse {
namespace {

constexpr int kMaxHold = 64;  // checks in a row a twice-burnt head must stay low to give back
constexpr double kTinyWeight = 1e-9;  // below it a tier holds nothing to take or share by

}  // namespace

absl::Status ValidateGuard(const GuardConfig& c) {
  auto bad = [](const char* flag, double v, const char* range) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be in ", range, ", got ", v));
  };
  if (!(c.sample_rate > 0 && c.sample_rate <= 1)) return bad("guard-rate", c.sample_rate, "(0, 1]");
  if (!(c.tolerance > 0 && c.tolerance < 10)) {
    return bad("guard-tolerance", c.tolerance, "(0, 10)");
  }
  if (!(c.relax_ratio >= 0 && c.relax_ratio < 1)) {
    return bad("guard-relax", c.relax_ratio, "[0, 1)");
  }
  if (!(c.grow > 1 && c.grow <= 16)) return bad("guard-grow", c.grow, "(1, 16]");
  if (!(c.shrink > 0 && c.shrink < 1)) return bad("guard-shrink", c.shrink, "(0, 1)");
  if (!(c.max_weight >= 1 && c.max_weight <= 1024)) {
    return bad("guard-max-weight", c.max_weight, "[1, 1024]");
  }
  return absl::OkStatus();
}

ErrorGuard::ErrorGuard(const GuardConfig& config, int num_layers, int num_kv_heads,
                       std::function<double(int layer, int kv_head)> base_weight)
    : config_(config),
      num_layers_(num_layers),
      num_kv_heads_(num_kv_heads),
      pairs_(num_layers * num_kv_heads),
      base_weight_(std::move(base_weight)),
      last_error_(pairs_, -1.0),
      low_streak_(pairs_, 0),
      hold_(pairs_, 1),
      escalated_from_(pairs_, -1.0),
      escalated_error_(pairs_, 0.0),
      cooldown_(pairs_, 0),
      due_(pairs_, 0) {}

void ErrorGuard::BeginStep() {
  if (!initialised_) {
    // At the first step, not at construction: the policy's weights (Fluxion's allocation) exist
    // once every head is prepared.
    base_.resize(pairs_);
    for (int l = 0; l < num_layers_; ++l) {
      for (int h = 0; h < num_kv_heads_; ++h) base_[Pair(l, h)] = std::max(0.0, base_weight_(l, h));
    }
    weight_ = base_;
    initialised_ = true;
  }
  step_weight_ = weight_;
  std::fill(due_.begin(), due_.end(), 0);
  // A small epsilon so that rate x pairs == 1 checks one pair at every step despite rounding.
  credit_ += config_.sample_rate * pairs_ + 1e-9;
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(credit_), pairs_);
  credit_ -= static_cast<double>(static_cast<int64_t>(credit_));
  for (int64_t i = 0; i < n; ++i) due_[(cursor_ + i) % pairs_] = 1;
  cursor_ = (cursor_ + n) % std::max(pairs_, 1);
}

bool ErrorGuard::Due(int layer, int kv_head) const { return due_[Pair(layer, kv_head)] != 0; }

double ErrorGuard::Shift(int layer, int kv_head) const {
  if (!initialised_) return 0.0;
  const int p = Pair(layer, kv_head);
  return step_weight_[p] - base_[p];
}

double ErrorGuard::Weight(int layer, int kv_head) const {
  return initialised_ ? weight_[Pair(layer, kv_head)] : 0.0;
}

double ErrorGuard::TotalWeight() const {
  double sum = 0;
  for (double w : weight_) sum += w;
  return sum;
}

void ErrorGuard::Report(int layer, int kv_head, double error, int64_t rows_read) {
  const int p = Pair(layer, kv_head);
  ++stats_.checks;
  stats_.check_rows += rows_read;
  stats_.errors.push_back(error);
  last_error_[p] = error;
  const double w = weight_[p];
  const bool low = error < config_.relax_ratio * config_.tolerance;
  low_streak_[p] = low ? low_streak_[p] + 1 : 0;
  if (escalated_from_[p] >= 0) {
    // Judge the last escalation: did the extra rows buy a smaller error?
    const double from = escalated_from_[p];
    escalated_from_[p] = -1;
    if (error > config_.tolerance && error > kFutileRatio * escalated_error_[p] && w > from) {
      Rebalance(p, from - w, /*evenly=*/true);
      ++stats_.reverts;
      cooldown_[p] = kCooldownChecks;
      return;
    }
  }
  if (cooldown_[p] > 0) {
    --cooldown_[p];
    if (error > config_.tolerance) return;
  }
  if (error > config_.tolerance) {
    const double target = std::min(config_.max_weight, std::max(config_.grow * w, w + 1.0));
    if (target > w) {
      Rebalance(p, target - w);
      if (weight_[p] > w) {
        ++stats_.escalations;
        hold_[p] = std::min(kMaxHold, 2 * hold_[p]);
        escalated_from_[p] = w;
        escalated_error_[p] = error;
      }
    }
  } else if (low && low_streak_[p] >= hold_[p] && w > 0) {
    Rebalance(p, (config_.shrink - 1.0) * w);
    if (weight_[p] < w) ++stats_.relaxations;
    low_streak_[p] = 0;
  }
}

void ErrorGuard::Rebalance(int p, double delta, bool evenly) {
  const double tol = config_.tolerance, relax = config_.relax_ratio * tol;
  // The other pairs by what their last check said.
  std::vector<int> low, mid, high;
  for (int j = 0; j < pairs_; ++j) {
    if (j == p) continue;
    const double e = last_error_[j];
    (e >= 0 && e < relax ? low : e > tol ? high : mid).push_back(j);
  }
  if (delta > 0) {
    // Take from the tiers in order, each in proportion to its members' weights.
    double left = delta;
    for (const std::vector<int>* tier : {&low, &mid, &high}) {
      double sum = 0;
      for (int j : *tier) sum += weight_[j];
      if (sum <= kTinyWeight || left <= 0) continue;
      const double take = std::min(left, sum);
      for (int j : *tier) weight_[j] = std::max(0.0, weight_[j] - take * weight_[j] / sum);
      left -= take;
    }
    weight_[p] += delta - left;
    return;
  }
  // Give -delta to the heads short of budget first, then to everyone else, none above the cap.
  double left = -delta;
  auto give = [&](const std::vector<int>& tier) {
    for (int round = 0; round < 4 && left > 1e-12; ++round) {
      double sum = 0, room = 0;
      for (int j : tier) {
        if (weight_[j] < config_.max_weight) sum += weight_[j], room += config_.max_weight - weight_[j];
      }
      if (room <= 0) return;
      const double amount = std::min(left, room);
      double given = 0;
      for (int j : tier) {
        if (weight_[j] >= config_.max_weight) continue;
        // Proportional to weight; uniform when the open members hold none.
        // (A sum within rounding of 0 counts as 0: weights taken to nothing leave ~1e-17.)
        const double share =
            sum > kTinyWeight ? weight_[j] / sum : (config_.max_weight - weight_[j]) / room;
        const double add = std::min(amount * share, config_.max_weight - weight_[j]);
        weight_[j] += add;
        given += add;
      }
      left -= given;
    }
  };
  std::vector<int> rest = low;
  rest.insert(rest.end(), mid.begin(), mid.end());
  if (evenly) {
    rest.insert(rest.end(), high.begin(), high.end());
  } else {
    give(high);
  }
  give(rest);
  weight_[p] += delta + left;  // what found no taker stays with p
}

}  // namespace fluxion::decode::sparse
