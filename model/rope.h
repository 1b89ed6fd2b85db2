// RoPE inverse frequencies after scaling, computed once per model.
#ifndef FLUXION_MODEL_ROPE_H_
#define FLUXION_MODEL_ROPE_H_

#include <cstdint>
#include <vector>

#include "model/config.h"

namespace fluxion::model {

// Returns inv_freq[head_dim / 2] for `rope`, following transformers' `_compute_*_parameters`:
//   default: theta^(-2i/d); linear: default / factor;
//   llama3: wavelengths above original_max/low_freq_factor are divided by `factor`, those below
//   original_max/high_freq_factor kept, and the band between interpolated smoothly.
// Empty when head_dim is outside (0, kMaxHeadDim].
std::vector<float> ComputeInvFreq(const RopeConfig& rope, int64_t head_dim);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_ROPE_H_
