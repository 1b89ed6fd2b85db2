#include "model/logprobs.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace fluxion::model {

double LogSumExp(absl::Span<const float> logits) {
  if (logits.empty()) return -INFINITY;
  const double max = *std::max_element(logits.begin(), logits.end());
  if (!std::isfinite(max)) return max;
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  return max + std::log(sum);
}

TokenLogprobs LogprobsOfRow(absl::Span<const float> logits, int32_t token, int32_t top) {
  const double lse = LogSumExp(logits);
  TokenLogprobs out;
  out.token = token;
  out.logprob = static_cast<float>(logits[token] - lse);
  const int64_t n = std::min<int64_t>(top, static_cast<int64_t>(logits.size()));
  if (n == 0) return out;
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int64_t i = 0; i < n; ++i) {
    out.top_ids.push_back(order[i]);
    out.top_logprobs.push_back(static_cast<float>(logits[order[i]] - lse));
  }
  return out;
}

std::optional<TokenLogprobs> LogprobsOfCandidates(absl::Span<const int32_t> ids,
                                                  absl::Span<const float> logits,
                                                  double normaliser, int32_t token, int32_t top) {
  const int64_t n = static_cast<int64_t>(std::min(ids.size(), logits.size()));
  if (n == 0 || n < top || !(std::isfinite(normaliser) && normaliser > 0.0)) return std::nullopt;
  const double lse = static_cast<double>(logits[0]) + std::log(normaliser);
  TokenLogprobs out;
  out.token = token;
  bool found = false;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] == token) {
      out.logprob = static_cast<float>(logits[i] - lse);
      found = true;
      break;
    }
  }
  if (!found) return std::nullopt;
  for (int64_t i = 0; i < top; ++i) {
    out.top_ids.push_back(ids[i]);
    out.top_logprobs.push_back(static_cast<float>(logits[i] - lse));
  }
  return out;
}

}  // namespace fluxion::model
