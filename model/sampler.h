// Token sampling from logits: greedy, temperature, top-k, top-p, seeded.
//
// One draw, two entry points: Sample(full row) and SampleCandidates(the row's best tokens, as the
// device's candidate kernel gives them, kernels/cuda/sampling.h). Sample builds the candidate list
// on the host and runs the same draw, so the two cannot diverge: whenever a candidate list
// suffices, SampleCandidates returns the token Sample(full row) returns and advances the random
// stream identically. What suffices (CandidatesNeeded):
//   greedy (temperature 0 or top_k 1)      1 candidate
//   top_k > 0 (with or without top_p)      top_k candidates
//   top_p < 1 without top_k                candidates whose mass reaches top_p, measured against
//                                          the whole row's normaliser (sum over every token of
//                                          exp((x - max) / T)), which the device computes too
//   temperature alone                      every token: only the full row will do
// and, when the request asks for logprobs (model/logprobs.h), at least `logprobs` candidates and
// the row's normaliser at temperature 1 (NormaliserTemperature): its log-softmax. A top-p draw
// without top-k at another temperature would need a second normaliser: that row crosses whole.
//
// Top-p without top-k over a partial list: the device sums the normaliser in another order (and
// with CUDA's exp, within 1 ulp of the host's) than the host's sorted sum, so it may differ from
// the host's by a relative ~1e-11 at a 128K vocabulary. The top-p cut compares a running sum
// against top_p, so a cut within that distance of top_p could land on another token. We chose
// exactness over coverage: when the running sum at the cut (or just before it) is within
// kNormaliserBand (1e-9, relative) of top_p, SampleCandidates declines (returns nullopt) and the
// caller samples the full row; otherwise both normalisers give the same cut, hence the same token.
//
// Thread-compatible: one Sampler per sequence (it owns the sequence's random stream, so a seeded
// request gives the same tokens whatever else the server runs).
#ifndef FLUXION_MODEL_SAMPLER_H_
#define FLUXION_MODEL_SAMPLER_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "model/logit_penalties.h"
#include "model/logprobs.h"

namespace fluxion::model {

struct SamplingParams {
  double temperature = 0.0;  // <= 0: greedy (argmax, lowest id on ties)
  int64_t top_k = 0;         // 0: no limit
  double top_p = 1.0;        // nucleus: smallest set of tokens whose probability reaches top_p
  uint64_t seed = 0;
  // Log-probabilities of each drawn token and of the row's `logprobs` most likely tokens
  // (0..kMaxTopLogprobs); -1: none (Sampler::last_logprobs stays empty).
  int32_t logprobs = -1;
  // Repetition, frequency and presence penalties and min_tokens (model/logit_penalties.h). Rows
  // they change are drawn from the full row only.
  PenaltyParams penalties;
};

// InvalidArgument naming the field for a negative temperature or top_k, top_p outside (0, 1],
// logprobs outside [-1, kMaxTopLogprobs], presence or frequency penalties outside [-2, 2], a
// repetition penalty <= 0, or a negative min_tokens.
absl::Status ValidateSamplingParams(const SamplingParams& params);

// A row's best tokens in the sampler's order (descending logit, ties by lower id): the first
// ids.size() of the row's `vocab` tokens, with their logits.
struct Candidates {
  absl::Span<const int32_t> ids;
  absl::Span<const float> logits;  // logits[i] is token ids[i]'s
  int64_t vocab = 0;               // the whole row's length
  // Sum over the WHOLE row of exp((x - logits[0]) / T) at T = NormaliserTemperature(params);
  // read for top-p without top-k over a partial list and for logprobs (NaN: not computed).
  double normaliser = std::numeric_limits<double>::quiet_NaN();
};

// How many candidates a draw with `params` needs from a row of `vocab` tokens when at most
// `max_candidates` can be had: 1 for greedy, top_k, max_candidates for top-p without top-k (they
// suffice only when their mass reaches top_p), the whole row for temperature alone; each capped
// at vocab. 0 when that is more than max_candidates: the full row is needed.
int64_t CandidatesNeeded(const SamplingParams& params, int64_t vocab, int64_t max_candidates);
// Whether a draw from a partial list with `params` reads Candidates::normaliser.
bool NeedsNormaliser(const SamplingParams& params);
// The temperature at which a partial list's normaliser is summed for `params`: 1 when it asks for
// logprobs, its temperature for NeedsNormaliser, else 0 (none needed).
double NormaliserTemperature(const SamplingParams& params);

class Sampler {
 public:
  // The relative distance from top_p within which SampleCandidates does not trust a normaliser
  // summed in another order (see the header comment).
  static constexpr double kNormaliserBand = 1e-9;

  // REQUIRES: ValidateSamplingParams(params).ok().
  explicit Sampler(const SamplingParams& params);
  int32_t Sample(absl::Span<const float> logits);
  // The token Sample(the full row) returns, drawn from the row's candidates with the same advance
  // of the random stream; nullopt when the candidates do not suffice (too few, their mass below
  // top_p, a normaliser missing or too close to the cut): the stream has then not advanced and
  // the caller samples the full row. REQUIRES: `c` is a prefix of the row in the sampler's order.
  std::optional<int32_t> SampleCandidates(const Candidates& c);
  // CandidatesNeeded for this sampler's next draw: 0 while its penalties change rows.
  int64_t CandidatesNeeded(int64_t vocab, int64_t max_candidates) const;
  // Advances the random stream as one draw does, without a row: the draw made elsewhere (the
  // first token, drawn by the prefill node from the same seed).
  void SkipDraw();

  // What the penalties read: the prompt (repetition) and every output token, including one drawn
  // elsewhere; the owner reports each one it keeps.
  void SetPrompt(absl::Span<const int32_t> prompt) { history_.SetPrompt(prompt); }
  void Accept(int32_t token) { history_.Accept(token); }

  const SamplingParams& params() const { return params_; }
  // The last draw's log-probabilities when params().logprobs >= 0 (else nullopt).
  const std::optional<TokenLogprobs>& last_logprobs() const { return last_logprobs_; }

 private:
  // The draw both entry points share.
  std::optional<int32_t> Draw(const Candidates& c);
  // Sample's draw from the full row (without the logprobs).
  int32_t DrawRow(absl::Span<const float> logits);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;  // scratch
  std::vector<float> values_;   // scratch: the logits in order_'s order
  std::vector<double> probs_;   // scratch
  std::optional<TokenLogprobs> last_logprobs_;
  TokenHistory history_;
  std::vector<float> penalised_;  // scratch: the row with the penalties applied
};

// Index of the largest logit (lowest index among ties).
int32_t ArgMax(absl::Span<const float> logits);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_SAMPLER_H_
