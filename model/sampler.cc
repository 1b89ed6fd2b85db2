#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace fluxion::model {
namespace {

bool Greedy(const SamplingParams& p) { return p.temperature <= 0.0 || p.top_k == 1; }

}  // namespace

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
  const PenaltyParams& pen = p.penalties;
  for (const auto& [name, v] : {std::pair{"presence_penalty", pen.presence},
                                std::pair{"frequency_penalty", pen.frequency}}) {
    if (!(v >= -2.0 && v <= 2.0)) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be in [-2, 2], got ", v));
    }
  }
  if (!(pen.repetition > 0.0) || !std::isfinite(pen.repetition)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be a finite number > 0, got ", pen.repetition));
  }
  if (pen.min_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("min_tokens must be >= 0, got ", pen.min_tokens));
  }
  if (p.logprobs < -1 || p.logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("logprobs must be in [0, ", kMaxTopLogprobs,
                                                   "], got ", p.logprobs));
  }
  return absl::OkStatus();
}

int64_t CandidatesNeeded(const SamplingParams& p, int64_t vocab, int64_t max_candidates) {
  int64_t needed = vocab;  // temperature alone: every token
  if (Greedy(p)) {
    needed = 1;
  } else if (p.top_k > 0) {
    needed = p.top_k;
  } else if (p.top_p < 1.0) {
    needed = max_candidates;
  }
  if (p.logprobs >= 0) {
    // One normaliser per row: top-p without top-k at another temperature than 1 needs its own.
    if (NeedsNormaliser(p) && p.temperature != 1.0) return 0;
    needed = std::max<int64_t>(needed, p.logprobs);
  }
  needed = std::min(needed, vocab);
  return needed <= max_candidates ? needed : 0;
}

double NormaliserTemperature(const SamplingParams& p) {
  if (p.logprobs >= 0) return 1.0;
  return NeedsNormaliser(p) ? p.temperature : 0.0;
}

bool NeedsNormaliser(const SamplingParams& p) {
  return !Greedy(p) && p.top_k == 0 && p.top_p < 1.0;
}

int32_t ArgMax(absl::Span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

int32_t Sampler::Sample(absl::Span<const float> logits) {
  int32_t token;
  if (history_.Changes(params_.penalties)) {
    penalised_.assign(logits.begin(), logits.end());
    history_.Apply(params_.penalties, absl::MakeSpan(penalised_));
    token = DrawRow(penalised_);
  } else {
    token = DrawRow(logits);
  }
  // The logprobs are the raw row's (vLLM's raw_logprobs).
  if (params_.logprobs >= 0) last_logprobs_ = LogprobsOfRow(logits, token, params_.logprobs);
  return token;
}

int32_t Sampler::DrawRow(absl::Span<const float> logits) {
  if (Greedy(params_)) return ArgMax(logits);
  const int64_t vocab = static_cast<int64_t>(logits.size());
  const int64_t k = params_.top_k > 0 ? std::min(params_.top_k, vocab) : vocab;
  order_.resize(vocab);
  std::iota(order_.begin(), order_.end(), 0);
  // Descending by logit, ties by id, so the candidate order (and thus the draw) is deterministic.
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), by_logit);
  values_.resize(k);
  for (int64_t i = 0; i < k; ++i) values_[i] = logits[order_[i]];
  // top_k candidates, or the whole row: a list that always suffices (its own sum normalises).
  Candidates c;
  c.ids = absl::MakeConstSpan(order_.data(), k);
  c.logits = values_;
  c.vocab = vocab;
  return *Draw(c);
}

int64_t Sampler::CandidatesNeeded(int64_t vocab, int64_t max_candidates) const {
  if (history_.Changes(params_.penalties)) return 0;
  return model::CandidatesNeeded(params_, vocab, max_candidates);
}

void Sampler::SkipDraw() {
  // Every draw that is not greedy takes exactly one uniform variate (Draw), whatever its range.
  if (!Greedy(params_)) (void)std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
}

std::optional<int32_t> Sampler::SampleCandidates(const Candidates& c) {
  if (history_.Changes(params_.penalties)) return std::nullopt;  // the raw order no longer holds
  const int32_t top = params_.logprobs;
  if (top >= 0) {
    // Checked before the draw, so that a list that cannot give the logprobs leaves the stream
    // where it was. The drawn token is always one of the candidates.
    const bool two_temperatures = NeedsNormaliser(params_) && params_.temperature != 1.0;
    if (two_temperatures || std::min(c.ids.size(), c.logits.size()) < static_cast<size_t>(top) ||
        !(std::isfinite(c.normaliser) && c.normaliser > 0.0)) {
      return std::nullopt;
    }
  }
  std::optional<int32_t> token = Draw(c);
  if (token.has_value() && top >= 0) {
    last_logprobs_ = LogprobsOfCandidates(c.ids, c.logits, c.normaliser, *token, top);
  }
  return token;
}

std::optional<int32_t> Sampler::Draw(const Candidates& c) {
  const int64_t n = static_cast<int64_t>(std::min(c.ids.size(), c.logits.size()));
  if (n == 0 || c.vocab <= 0) return std::nullopt;
  if (Greedy(params_)) return c.ids[0];
  const bool whole = n >= c.vocab;
  int64_t k = n;
  if (params_.top_k > 0) {
    k = std::min(params_.top_k, c.vocab);
    if (n < k) return std::nullopt;
  } else if (!whole && !(params_.top_p < 1.0)) {
    return std::nullopt;  // temperature alone draws from every token
  }
  probs_.resize(k);
  const double max_logit = c.logits[0];
  double list_total = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    probs_[i] = std::exp((c.logits[i] - max_logit) / params_.temperature);
    list_total += probs_[i];
  }
  // The list's own sum normalises when it holds every token the draw may pick (top_k, or the
  // whole row); top-p over a partial list needs the whole row's.
  const bool own_total = params_.top_k > 0 || whole;
  const double total = own_total ? list_total : c.normaliser;
  if (!own_total && !(std::isfinite(total) && total > 0.0)) return std::nullopt;
  int64_t keep = k;
  if (params_.top_p < 1.0) {
    double cumulative = 0.0, before = 0.0;
    bool cut = false;
    for (int64_t i = 0; i < k; ++i) {
      before = cumulative;
      cumulative += probs_[i] / total;
      if (cumulative >= params_.top_p) {
        keep = i + 1;
        cut = true;
        break;
      }
    }
    if (!own_total) {
      if (!cut) return std::nullopt;  // the candidates' mass is below top_p
      // A normaliser summed in another order could move the cut by one token here.
      if (cumulative < params_.top_p * (1.0 + kNormaliserBand) ||
          before >= params_.top_p * (1.0 - kNormaliserBand)) {
        return std::nullopt;
      }
    }
  }
  const double kept_total = std::accumulate(probs_.begin(), probs_.begin() + keep, 0.0);
  const double r = std::uniform_real_distribution<double>(0.0, kept_total)(rng_);
  double cumulative = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    cumulative += probs_[i];
    if (r < cumulative) return c.ids[i];
  }
  return c.ids[keep - 1];
}

}  // namespace fluxion::model
