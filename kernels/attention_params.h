// Shape of one causal attention call, shared by every kernel implementation.
#ifndef FLUXION_KERNELS_ATTENTION_PARAMS_H_
#define FLUXION_KERNELS_ATTENTION_PARAMS_H_

#include <cstdint>

namespace fluxion::kernels {

struct AttentionParams {
  int64_t n = 0;     // new query tokens
  int64_t pos0 = 0;  // position of the first query; keys cover [0, pos0 + n)
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // query head h reads KV head h / (num_heads / num_kv_heads)
  int64_t head_dim = 0;
  float scale = 0.0f;  // applied to q.k before the (natural-base) softmax
};

}  // namespace fluxion::kernels

#endif  // FLUXION_KERNELS_ATTENTION_PARAMS_H_
