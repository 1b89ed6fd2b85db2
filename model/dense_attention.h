// The built-in SequenceAttention: fp32 K/V for every layer in one growable cache, causal full
// attention through kernels/cpu. This is the model's own path (prefill, `fluxion generate`) and
// the oracle the paged and sparse implementations in decode/ are compared with.
//
// Thread-compatible (one sequence, one driver thread).
#ifndef FLUXION_MODEL_DENSE_ATTENTION_H_
#define FLUXION_MODEL_DENSE_ATTENTION_H_

#include <vector>

#include "model/attention.h"

namespace fluxion::model {

class DenseAttention : public SequenceAttention {
 public:
  // `max_tokens` bounds the cache (ResourceExhausted beyond it); 0 means unbounded.
  explicit DenseAttention(const AttentionShape& shape, int64_t max_tokens = 0);

  absl::Status Forward(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                       const float* v, float* out) override;

  int64_t length(int layer) const { return lengths_[layer]; }
  // K/V rows of `layer`: [length][num_kv_heads][head_dim].
  const float* keys(int layer) const { return k_[layer].data(); }
  const float* values(int layer) const { return v_[layer].data(); }

 private:
  AttentionShape shape_;
  int64_t max_tokens_;
  std::vector<std::vector<float>> k_, v_;  // [layer] -> [length][num_kv_heads][head_dim]
  std::vector<int64_t> lengths_;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_DENSE_ATTENTION_H_
