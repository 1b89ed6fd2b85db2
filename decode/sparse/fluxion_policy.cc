#include "decode/sparse/fluxion_policy.h"

#include <algorithm>
#include <cmath>

namespace fluxion::decode::sparse {

FluxionPolicy::FluxionPolicy(const PolicyConfig& config,
                             std::shared_ptr<const FluxionPredictor> predictor)
    : LfpsPolicy(config, LfpsParams{}, /*paper_bypass=*/false), predictor_(std::move(predictor)) {}

absl::Status FluxionPolicy::Prepare(const PagedKv& kv, int layer, int kv_head,
                                    const model::HeadSparseState* state) {
  if (state != nullptr) {
    // Only the five scalar features: the tables are LFPS's and stay there.
    model::HeadSparseState f;
    f.middle_share = state->middle_share;
    f.need_fraction = state->need_fraction;
    f.sink_mass = state->sink_mass;
    f.local_mass = state->local_mass;
    f.entropy = state->entropy;
    features_[{layer, kv_head}] = f;
  }
  return LfpsPolicy::Prepare(kv, layer, kv_head, state);
}

void FluxionPolicy::Allocate() {
  double total = 0;
  if (predictor_ != nullptr) {
    // Every layer of the model is prepared before the first step, so the largest layer seen
    // gives num_layers (a replay of one layer sees layer 0 only, and layer_frac 0).
    int num_layers = 0;
    for (const auto& [key, f] : features_) num_layers = std::max(num_layers, key.first + 1);
    for (const auto& [key, f] : features_) {
      const HeadPrediction p = predictor_->Predict(HeadFeatures(f, key.first, num_layers));
      weight_[key] = p.tier;  // 0 for a streaming head
      total += p.tier;
    }
  } else {
    for (const auto& [key, s] : states_) {
      const bool streaming = s.middle_share < 1.0 - params_.bypass_rho;
      const double w = streaming ? 0.0 : s.middle_share * std::max(s.need_fraction, 1e-3);
      weight_[key] = w;
      total += w;
    }
  }
  const double heads = static_cast<double>(weight_.size());
  // An all-streaming request: the predictor means it (nothing from the middle); the rules keep
  // v1's uniform split.
  const double all_streaming = predictor_ != nullptr ? 0.0 : 1.0;
  for (auto& [key, w] : weight_) w = total > 0 ? w * heads / total : all_streaming;
  allocated_ = true;
}

double FluxionPolicy::HeadWeight(int layer, int kv_head) {
  if (!allocated_) Allocate();
  auto it = weight_.find({layer, kv_head});
  return it == weight_.end() ? 1.0 : it->second;
}

int64_t FluxionPolicy::MiddleBudget(int layer, int kv_head, const Regions& r, int64_t context) {
  // All heads are prepared before the first decode step; heads never seen at prefill (no tail
  // recorded) keep the uniform budget.
  const double w = HeadWeight(layer, kv_head);
  const int64_t middle = r.local_begin - r.sink_end;
  return std::clamp<int64_t>(static_cast<int64_t>(std::llround(w * r.middle_rows_budget)), 0,
                             middle);
}

}  // namespace fluxion::decode::sparse
