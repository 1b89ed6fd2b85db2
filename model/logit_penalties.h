// vLLM's sampling penalties and min_tokens, applied to a full row of logits before the draw:
//   repetition  a token of the prompt or the output: x / r when x > 0, else x * r (r > 1 lowers)
//   frequency   x -= f * (times the token is in the output)
//   presence    x -= p when the token is in the output at all
//   min_tokens  until that many output tokens exist, the stop tokens (EOS unless ignore_eos, and
//               stop_token_ids) are ruled out (-inf)
// in that order, as vLLM's `apply_penalties` and its min-tokens logits processor do. The
// log-probabilities a request asks for stay those of the raw row (model/logprobs.h).
//
// A penalised row no longer has the raw row's order, so the device's candidate list (model/
// sampler.h) cannot serve it: while any of these changes a row, the row crosses whole.
//
// Thread-compatible: one per sequence, inside its Sampler.
#ifndef FLUXION_MODEL_LOGIT_PENALTIES_H_
#define FLUXION_MODEL_LOGIT_PENALTIES_H_

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "absl/types/span.h"

namespace fluxion::model {

struct PenaltyParams {
  double presence = 0.0;    // OpenAI's presence_penalty, [-2, 2]
  double frequency = 0.0;   // OpenAI's frequency_penalty, [-2, 2]
  double repetition = 1.0;  // vLLM's repetition_penalty, > 0 (1: off)
  int64_t min_tokens = 0;   // vLLM's min_tokens
  std::vector<int32_t> stop_token_ids;  // what min_tokens holds back
};

// The tokens a sequence's penalties read: its prompt (repetition) and its output so far.
class TokenHistory {
 public:
  void SetPrompt(absl::Span<const int32_t> prompt);
  void Accept(int32_t token);
  int64_t output_tokens() const { return output_tokens_; }

  // Whether Apply changes a row now (a penalty is set and has tokens to act on, or min_tokens
  // still holds stop tokens back).
  bool Changes(const PenaltyParams& p) const;
  // Applies `p` to `row` (ids outside it are skipped).
  void Apply(const PenaltyParams& p, absl::Span<float> row) const;

 private:
  std::vector<int32_t> prompt_;  // sorted, unique
  std::unordered_map<int32_t, int64_t> output_counts_;
  int64_t output_tokens_ = 0;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_LOGIT_PENALTIES_H_
