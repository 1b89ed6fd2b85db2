// The seam between the transformer and whatever stores K/V and computes attention.
//
// `model/` owns the layer loop; each layer hands its new tokens' queries, keys and values (RoPE
// already applied) to a SequenceAttention and gets the attention output back. The built-in
// implementation (DenseAttention, dense_attention.h) keeps fp32 K/V in its own growable cache and
// runs causal full attention. `decode/` plugs in paged host-memory KV and sparse policies through
// the same interface, so `model/` never depends on `decode/`.
//
// Thread-compatible: one sequence is driven by one thread at a time.
#ifndef FLUXION_MODEL_ATTENTION_H_
#define FLUXION_MODEL_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"

namespace fluxion::model {

struct AttentionShape {
  int64_t num_layers = 0;
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;  // query head h uses KV head h / (num_heads / num_kv_heads)
  int64_t head_dim = 0;
  float scale = 0.0f;        // softmax scale, 1/sqrt(head_dim) for Llama/Qwen2
};

class SequenceAttention {
 public:
  virtual ~SequenceAttention() = default;

  // Stores K/V for tokens at positions [pos0, pos0 + n) of `layer` and writes the attention output
  // for their queries. Causal: the query at position p attends to positions [0, p].
  //   q:   [n][num_heads][head_dim]
  //   k,v: [n][num_kv_heads][head_dim]
  //   out: [n][num_heads][head_dim]
  // REQUIRES: pos0 equals the number of tokens already stored for `layer`.
  // Errors: ResourceExhausted when the sequence cannot grow (capacity, memory pool);
  // InvalidArgument for a position gap (a bug in the caller, reported rather than corrupting).
  virtual absl::Status Forward(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                               const float* v, float* out) = 0;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_ATTENTION_H_
