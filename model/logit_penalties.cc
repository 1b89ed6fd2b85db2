#include "model/logit_penalties.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace fluxion::model {

void TokenHistory::SetPrompt(absl::Span<const int32_t> prompt) {
  prompt_.assign(prompt.begin(), prompt.end());
  std::sort(prompt_.begin(), prompt_.end());
  prompt_.erase(std::unique(prompt_.begin(), prompt_.end()), prompt_.end());
}

void TokenHistory::Accept(int32_t token) {
  ++output_counts_[token];
  ++output_tokens_;
}

bool TokenHistory::Changes(const PenaltyParams& p) const {
  const bool seen = !prompt_.empty() || !output_counts_.empty();
  if (p.repetition != 1.0 && seen) return true;
  if ((p.presence != 0.0 || p.frequency != 0.0) && !output_counts_.empty()) return true;
  return output_tokens_ < p.min_tokens && !p.stop_token_ids.empty();
}

void TokenHistory::Apply(const PenaltyParams& p, absl::Span<float> row) const {
  const int64_t vocab = static_cast<int64_t>(row.size());
  auto inside = [vocab](int32_t id) { return id >= 0 && id < vocab; };
  if (p.repetition != 1.0) {
    const float r = static_cast<float>(p.repetition);
    auto penalise = [&](int32_t id) {
      float& x = row[id];
      x = x > 0 ? x / r : x * r;
    };
    // A token in both the prompt and the output is penalised once.
    for (int32_t id : prompt_) {
      if (inside(id)) penalise(id);
    }
    for (const auto& [id, count] : output_counts_) {
      if (inside(id) && !std::binary_search(prompt_.begin(), prompt_.end(), id)) penalise(id);
    }
  }
  if (p.presence != 0.0 || p.frequency != 0.0) {
    for (const auto& [id, count] : output_counts_) {
      if (!inside(id)) continue;
      row[id] -= static_cast<float>(p.frequency * static_cast<double>(count) + p.presence);
    }
  }
  if (output_tokens_ < p.min_tokens) {
    for (int32_t id : p.stop_token_ids) {
      if (inside(id)) row[id] = -std::numeric_limits<float>::infinity();
    }
  }
}

}  // namespace fluxion::model
