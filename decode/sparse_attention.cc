#include "decode/sparse_attention.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/paged_attention_cpu.h"

namespace fluxion::decode {

absl::StatusOr<std::unique_ptr<SparseAttention>> SparseAttention::FromDense(
    KvArena* arena, const model::AttentionShape& shape, int64_t page_tokens,
    const model::DenseAttention& prefilled, const sparse::PolicyConfig& policy) {
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  if (!kernels::cpu::PagedAttentionSupported(shape.head_dim, group, page_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CPU paged kernel does not support head_dim ", shape.head_dim,
                     ", GQA group ", group, ", page_tokens ", page_tokens));
  }
  KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, page_tokens};
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<PagedKv> kv, PagedKv::Create(arena, kv_shape));
  const int64_t row = shape.num_kv_heads * shape.head_dim;
  for (int layer = 0; layer < shape.num_layers; ++layer) {
    // On failure `kv` is destroyed and returns every page it took.
    FLUXION_RETURN_IF_ERROR(kv->Append(layer, prefilled.length(layer), prefilled.keys(layer),
                                       prefilled.values(layer), row));
  }
  return std::unique_ptr<SparseAttention>(
      new SparseAttention(shape, std::move(kv), sparse::MakePolicy(policy)));
}

absl::Status SparseAttention::Forward(int layer, int64_t pos0, int64_t n, const float* q,
                                      const float* k, const float* v, float* out) {
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  if (pos0 != kv_->length(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": tokens start at ", pos0,
                                                   " but the pages hold ", kv_->length(layer)));
  }
  const int64_t d = shape_.head_dim, hq = shape_.num_heads, hkv = shape_.num_kv_heads;
  const int64_t group = hq / hkv;
  FLUXION_RETURN_IF_ERROR(kv_->Append(layer, n, k, v, hkv * d));
  lse_.resize(group);
  const kernels::PagedKvView view = kv_->view();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t context = pos0 + i + 1;
    for (int kvh = 0; kvh < hkv; ++kvh) {
      // Query heads kvh*group .. kvh*group+group-1 share this KV head and sit next to each other.
      const float* qg = q + (i * hq + kvh * group) * d;
      float* og = out + (i * hq + kvh * group) * d;
      spans_.clear();
      if (n == 1) {
        sparse::SelectionInput in{kv_.get(), layer, kvh, qg, group, shape_.scale, context};
        policy_->Select(in, &spans_, &stats_);
      } else {
        sparse::AppendTokenRange(*kv_, layer, kvh, 0, context, &spans_);
      }
      kernels::cpu::PagedAttention(view, spans_.data(), spans_.size(),
                                   {qg, group, shape_.scale}, {og, lse_.data()});
    }
  }
  return absl::OkStatus();
}

}  // namespace fluxion::decode
