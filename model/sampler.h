// Token sampling from logits: greedy, temperature, top-k, top-p, seeded.
//
// Thread-compatible: one Sampler per sequence (it owns the sequence's random stream, so a seeded
// request gives the same tokens whatever else the server runs).
#ifndef FLUXION_MODEL_SAMPLER_H_
#define FLUXION_MODEL_SAMPLER_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace fluxion::model {

struct SamplingParams {
  double temperature = 0.0;  // <= 0: greedy (argmax, lowest id on ties)
  int64_t top_k = 0;         // 0: no limit
  double top_p = 1.0;        // nucleus: smallest set of tokens whose probability reaches top_p
  uint64_t seed = 0;
};

// InvalidArgument naming the field for a negative temperature or top_k, or top_p outside (0, 1].
absl::Status ValidateSamplingParams(const SamplingParams& params);

class Sampler {
 public:
  // REQUIRES: ValidateSamplingParams(params).ok().
  explicit Sampler(const SamplingParams& params);
  int32_t Sample(absl::Span<const float> logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;  // scratch
  std::vector<double> probs_;   // scratch
};

// Index of the largest logit (lowest index among ties).
int32_t ArgMax(absl::Span<const float> logits);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_SAMPLER_H_
