#include "model/dense_attention.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_ops.h"

namespace fluxion::model {

DenseAttention::DenseAttention(const AttentionShape& shape, int64_t max_tokens)
    : shape_(shape),
      max_tokens_(max_tokens),
      k_(shape.num_layers),
      v_(shape.num_layers),
      lengths_(shape.num_layers, 0),
      queries_(shape.num_layers),
      positions_(shape.num_layers) {}

absl::Status DenseAttention::Forward(int layer, int64_t pos0, int64_t n, const float* q,
                                     const float* k, const float* v, float* out) {
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  if (pos0 != lengths_[layer]) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": tokens start at ", pos0,
                                                   " but the cache holds ", lengths_[layer]));
  }
  if (max_tokens_ > 0 && pos0 + n > max_tokens_) {
    return absl::ResourceExhaustedError(absl::StrCat("sequence of ", pos0 + n,
                                                     " tokens exceeds the cache limit of ",
                                                     max_tokens_));
  }
  const int64_t row = shape_.num_kv_heads * shape_.head_dim;
  k_[layer].insert(k_[layer].end(), k, k + n * row);
  v_[layer].insert(v_[layer].end(), v, v + n * row);
  lengths_[layer] += n;
  if (record_end_ > record_from_) {
    const int64_t q_row = shape_.num_heads * shape_.head_dim;
    const int64_t end = std::min(n, record_end_ - pos0);
    for (int64_t i = std::max<int64_t>(0, record_from_ - pos0); i < end; ++i) {
      queries_[layer].insert(queries_[layer].end(), q + i * q_row, q + (i + 1) * q_row);
      positions_[layer].push_back(pos0 + i);
    }
  }
  kernels::AttentionParams p{n, pos0, shape_.num_heads, shape_.num_kv_heads, shape_.head_dim,
                             shape_.scale};
  kernels::cpu::CausalAttention(q, k_[layer].data(), v_[layer].data(), out, p);
  return absl::OkStatus();
}

}  // namespace fluxion::model
