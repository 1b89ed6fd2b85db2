#include "model/rope.h"

#include <cmath>

namespace fluxion::model {

std::vector<float> ComputeInvFreq(const RopeConfig& rope, int64_t head_dim) {
  // ParseModelConfig bounds head_dim; a hand-built config outside the bound gets no frequencies
  // (and the model's shape checks then fail) rather than a vector of length -1 or 2^62.
  if (head_dim <= 0 || head_dim > kMaxHeadDim) return {};
  const int64_t half = head_dim / 2;
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    // transformers evaluates this in float32: base ** (arange(0, d, 2).float() / d).
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    double f = 1.0 / std::pow(rope.theta, static_cast<double>(exponent));
    switch (rope.type) {
      case RopeType::kDefault:
        break;
      case RopeType::kLinear:
        f /= rope.factor;
        break;
      case RopeType::kLlama3: {
        const double old_len = static_cast<double>(rope.original_max_position_embeddings);
        const double low_freq_wavelen = old_len / rope.low_freq_factor;
        const double high_freq_wavelen = old_len / rope.high_freq_factor;
        const double wavelen = 2.0 * M_PI / f;
        if (wavelen > low_freq_wavelen) {
          f /= rope.factor;  // long wavelengths: fully interpolated
        } else if (wavelen >= high_freq_wavelen) {
          const double smooth = (old_len / wavelen - rope.low_freq_factor) /
                                (rope.high_freq_factor - rope.low_freq_factor);
          f = (1.0 - smooth) * f / rope.factor + smooth * f;
        }  // short wavelengths: unchanged
        break;
      }
    }
    inv_freq[i] = static_cast<float>(f);
  }
  return inv_freq;
}

}  // namespace fluxion::model
