#include "decode/sparse/fluxion_policy.h"

#include <algorithm>
#include <cmath>

namespace fluxion::decode::sparse {

FluxionPolicy::FluxionPolicy(const PolicyConfig& config)
    : LfpsPolicy(config, LfpsParams{}, /*paper_bypass=*/false) {}

void FluxionPolicy::Allocate() {
  double total = 0;
  for (const auto& [key, s] : states_) {
    const bool streaming = s.middle_share < 1.0 - params_.bypass_rho;
    const double w = streaming ? 0.0 : s.middle_share * std::max(s.need_fraction, 1e-3);
    weight_[key] = w;
    total += w;
  }
  const double heads = static_cast<double>(states_.size());
  for (auto& [key, w] : weight_) w = total > 0 ? w * heads / total : 1.0;
  allocated_ = true;
}

int64_t FluxionPolicy::MiddleBudget(int layer, int kv_head, const Regions& r, int64_t context) {
  // All heads are prepared before the first decode step; heads never seen at prefill (no tail
  // recorded) keep the uniform budget.
  if (!allocated_) Allocate();
  auto it = weight_.find({layer, kv_head});
  const double w = it == weight_.end() ? 1.0 : it->second;
  const int64_t middle = r.local_begin - r.sink_end;
  return std::clamp<int64_t>(static_cast<int64_t>(std::llround(w * r.middle_rows_budget)), 0,
                             middle);
}

}  // namespace fluxion::decode::sparse
