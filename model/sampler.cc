#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace fluxion::model {

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  if (!(p.temperature >= 0.0) || !std::isfinite(p.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be a finite number >= 0, got ", p.temperature));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", p.top_k));
  }
  if (!(p.top_p > 0.0 && p.top_p <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", p.top_p));
  }
  return absl::OkStatus();
}

int32_t ArgMax(absl::Span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

int32_t Sampler::Sample(absl::Span<const float> logits) {
  if (params_.temperature <= 0.0 || params_.top_k == 1) return ArgMax(logits);
  const int64_t vocab = static_cast<int64_t>(logits.size());
  const int64_t k = params_.top_k > 0 ? std::min(params_.top_k, vocab) : vocab;
  order_.resize(vocab);
  std::iota(order_.begin(), order_.end(), 0);
  // Descending by logit, ties by id, so the candidate order (and thus the draw) is deterministic.
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), by_logit);
  probs_.resize(k);
  const double max_logit = logits[order_[0]];
  double total = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    probs_[i] = std::exp((logits[order_[i]] - max_logit) / params_.temperature);
    total += probs_[i];
  }
  int64_t keep = k;
  if (params_.top_p < 1.0) {
    double cumulative = 0.0;
    for (int64_t i = 0; i < k; ++i) {
      cumulative += probs_[i] / total;
      if (cumulative >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  const double kept_total = std::accumulate(probs_.begin(), probs_.begin() + keep, 0.0);
  const double r = std::uniform_real_distribution<double>(0.0, kept_total)(rng_);
  double cumulative = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    cumulative += probs_[i];
    if (r < cumulative) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace fluxion::model
