#include "model/logprobs.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace fluxion::model {

double LogSumExp(absl::Span<const float> logits) {
  if (logits.empty()) return -INFINITY;
  const double max = *std::max_element(logits.begin(), logits.end());
  if (!std::isfinite(max)) return max;
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  return max + std::log(sum);
}

namespace {

// The row's `n` most likely (logit, id) pairs, most likely first, lower id first on ties, in one
// pass with no allocation beyond the answer: a prompt-logprobs request asks this of every prompt
// row over the whole vocabulary, so a sort of an index per row would dominate it. Ids arrive in
// ascending order, so an equal logit never displaces a kept one (the kept id is lower).
std::vector<std::pair<float, int32_t>> TopOfRow(absl::Span<const float> logits, int64_t n) {
  std::vector<std::pair<float, int32_t>> kept;
  kept.reserve(n);
  for (int64_t id = 0; id < static_cast<int64_t>(logits.size()); ++id) {
    const float x = logits[id];
    if (static_cast<int64_t>(kept.size()) == n) {
      if (!(x > kept.back().first)) continue;
      kept.pop_back();
    }
    // The first kept entry this one beats; ties keep the kept (lower) id first.
    auto at = std::find_if(kept.begin(), kept.end(),
                           [x](const std::pair<float, int32_t>& k) { return x > k.first; });
    kept.insert(at, {x, static_cast<int32_t>(id)});
  }
  return kept;
}

}  // namespace

TokenLogprobs LogprobsOfRow(absl::Span<const float> logits, int32_t token, int32_t top) {
  const double lse = LogSumExp(logits);
  TokenLogprobs out;
  out.token = token;
  out.logprob = static_cast<float>(logits[token] - lse);
  const int64_t n = std::min<int64_t>(top, static_cast<int64_t>(logits.size()));
  if (n <= 0) return out;
  for (const auto& [logit, id] : TopOfRow(logits, n)) {
    out.top_ids.push_back(id);
    out.top_logprobs.push_back(static_cast<float>(logit - lse));
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
