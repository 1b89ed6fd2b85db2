// Log-probabilities of a position's token and of its most likely alternatives, as OpenAI's
// `logprobs` / `top_logprobs` and vLLM's `prompt_logprobs` report them.
//
// They come from the model's raw logits: a log-softmax over the whole vocabulary, before the
// sampler's temperature, top-k or top-p (vLLM's default, `logprobs_mode=raw_logprobs`), so a
// client reads the same numbers whatever it samples with. Computed where the logits are: from the
// full row on the host, or from the device's candidate list (model/sampler.h Candidates) and the
// row's normaliser summed at temperature 1, which is all a row's log-softmax needs:
//   logprob(x_i) = x_i - max - log(sum_j exp(x_j - max)).
#ifndef FLUXION_MODEL_LOGPROBS_H_
#define FLUXION_MODEL_LOGPROBS_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"

namespace fluxion::model {

// The most alternatives one position may report (vLLM's default --max-logprobs, OpenAI's
// top_logprobs ceiling).
inline constexpr int32_t kMaxTopLogprobs = 20;

struct TokenLogprobs {
  int32_t token = -1;
  float logprob = 0.0f;
  // The row's `top` most likely tokens, most likely first (ties: lower id first, as the sampler
  // orders them), and their log-probabilities.
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};

// log(sum_j exp(x_j)) of a row, in double (max-shifted).
double LogSumExp(absl::Span<const float> logits);

// `token`'s log-probability in the full row `logits` and the row's `top` most likely tokens.
// REQUIRES: 0 <= token < logits.size(), 0 <= top.
TokenLogprobs LogprobsOfRow(absl::Span<const float> logits, int32_t token, int32_t top);

// The same from a candidate list in the sampler's order (`ids`, `logits`: a prefix of the row,
// most likely first) and the row's normaliser at temperature 1 (sum over the whole row of
// exp(x - logits[0])). nullopt when the list cannot answer: fewer than `top` candidates, `token`
// not among them, or a normaliser that is not a finite positive number.
std::optional<TokenLogprobs> LogprobsOfCandidates(absl::Span<const int32_t> ids,
                                                  absl::Span<const float> logits,
                                                  double normaliser, int32_t token, int32_t top);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_LOGPROBS_H_
