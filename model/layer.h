// One transformer layer as two halves over a batch of stacked rows, written once over DenseOps
// (dense_ops.h) and shared by Model::Forward, Model::ForwardBatch and the batched decode step
// (decode_step.h). The rows may belong to many requests, each at its own position: RoPE takes a
// position per row, and everything else is per row or a product over all rows at once, so each
// weight matrix is read once per layer for the whole batch.
//
//   PreAttention:  normed = RMSNorm(x); q, k, v = projections of normed; RoPE(q, k)
//   (attention: the caller's, between the halves: q/k/v -> attn, one row per query token)
//   PostAttention: x += o_proj(attn); x += down(silu(gate(RMSNorm(x))) * up(RMSNorm(x)))
//
// A backend that offers FusedDenseOps (dense_ops.h) runs each half with its fused operations once
// the layer's weights are stacked (FuseParams): PreAttention is RMSNorm -> one q/k/v product ->
// split + bias + RoPE, PostAttention o -> RMSNorm -> one gate/up product -> SiLU * up -> down,
// each activation written in the products' input format by the operation before. layer.cc's
// FusedFor is the one place that decides; the CPU backend offers no fused ops and runs the plain
// halves unchanged.
//
// All pointers below are in the memory of the DenseOps that runs them.
#ifndef FLUXION_MODEL_LAYER_H_
#define FLUXION_MODEL_LAYER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "model/config.h"
#include "model/dense_ops.h"

namespace fluxion::model {

struct LinearParams {
  WeightRef weight;               // [out][in], in the backend's format (DenseOps::UploadWeight)
  const float* bias = nullptr;    // [out] or null
  int64_t out = 0;
  int64_t in = 0;
};

struct LayerParams {
  const float* input_norm = nullptr;  // [hidden]
  LinearParams q, k, v, o;
  const float* post_attention_norm = nullptr;  // [hidden]
  LinearParams gate, up, down;
  // The stacked forms FuseParams makes: qkv [q.out + k.out + v.out][hidden] (q rows, then k, then
  // v; bias likewise or null) and gate_up [gate.out + up.out][hidden]. Empty (null weight) until
  // then; once made, q/k/v/gate/up view their rows of these, so the plain path still works.
  LinearParams qkv, gate_up;
};

// Every weight of a model, in one DenseOps's memory: the matrices in its format (WeightRef), the
// vectors fp32. Move-only: it may own the uploaded copies.
struct ModelParams {
  WeightRef embed;                    // [vocab][hidden]
  std::vector<LayerParams> layers;
  const float* final_norm = nullptr;  // [hidden]
  WeightRef lm_head;                  // [vocab][hidden] (the embedding's handle when tied)
  const float* inv_freq = nullptr;    // [head_dim / 2], RoPE frequencies after scaling
  std::vector<std::unique_ptr<OpsBuffer>> owned;  // empty when the pointers borrow host weights
};

// Stacks every layer's q/k/v and gate/up weights (and biases) into one matrix each when `ops`
// offers fused operations; a no-op otherwise (and for a layer whose q/k/v have biases on some
// projections only). The separate copies the params own are freed as each layer is stacked (the
// stacked copy is made on the device, so memory peaks one layer above the model's).
// ResourceExhausted when the stacked copy cannot be allocated.
absl::Status FuseParams(DenseOps& ops, ModelParams* params);

// A second ModelParams over the same weights, owning nothing (for a DenseOps that may read them:
// DenseOps::CanUseWeightsOf). Every pointer stays valid while `owner`'s buffers live. Run
// FuseParams on the owner first: stacking frees the separate copies a borrow would point to.
ModelParams BorrowParams(const ModelParams& owner);

// The activations of up to `capacity` stacked rows, in a DenseOps's memory.
class StepBuffers {
 public:
  // ResourceExhausted when the backend cannot allocate them.
  static absl::StatusOr<StepBuffers> Create(DenseOps& ops, const ModelConfig& config,
                                            int64_t capacity);

  int64_t capacity = 0;
  float* x = nullptr;          // [rows][hidden], the residual stream
  float* normed = nullptr;     // [rows][hidden]
  float* q = nullptr;          // [rows][num_heads][head_dim], post-RoPE
  float* k = nullptr;          // [rows][num_kv_heads][head_dim], post-RoPE
  float* v = nullptr;          // [rows][num_kv_heads][head_dim]
  float* attn = nullptr;       // [rows][num_heads][head_dim], the attention output
  float* gate = nullptr;       // [rows][intermediate]
  float* up = nullptr;         // [rows][intermediate]
  int64_t* positions = nullptr;  // [rows]
  int32_t* tokens = nullptr;     // [rows]
  // Only when the ops offer FusedDenseOps (null otherwise):
  void* gemm_input = nullptr;    // [rows][max(hidden, q width, intermediate)], GEMM-input format
  float* qkv = nullptr;          // [rows][(num_heads + 2 num_kv_heads) * head_dim]
  float* gate_up = nullptr;      // [rows][2 * intermediate]

 private:
  std::vector<std::unique_ptr<OpsBuffer>> owned_;
};

// x[i] = embed[tokens[i]], positions copied, for `rows` rows from host arrays.
// REQUIRES: rows <= buf.capacity, every token id valid.
void EmbedRows(DenseOps& ops, const ModelParams& params, const ModelConfig& config,
               const StepBuffers& buf, const int32_t* host_tokens, const int64_t* host_positions,
               int64_t rows);

void PreAttention(DenseOps& ops, const ModelConfig& config, const LayerParams& w,
                  const float* inv_freq, const StepBuffers& buf, int64_t rows);
void PostAttention(DenseOps& ops, const ModelConfig& config, const LayerParams& w,
                   const StepBuffers& buf, int64_t rows);

// logits[i] = lm_head . RMSNorm(x_rows[i]) for n contiguous rows of x_rows ([n][hidden]); uses
// buf.normed as scratch. logits: [n][vocab] in backend memory.
void LmHead(DenseOps& ops, const ModelParams& params, const ModelConfig& config,
            const StepBuffers& buf, const float* x_rows, int64_t n, float* logits);

// Attention between the halves of layer `layer` over the first `rows` rows of the buffers: reads
// q/k/v, writes attn. Returns how many rows go on: a callback that drops rows compacts the
// survivors (x, attn and positions) to the front first.
using AttendFn = absl::FunctionRef<absl::StatusOr<int64_t>(int layer, int64_t rows)>;

// Every layer over the first `rows` rows (x and positions set): PreAttention, attend,
// PostAttention. Returns the rows left after the last layer (it stops early when none are), or the
// first error of attend.
absl::StatusOr<int64_t> RunLayers(DenseOps& ops, const ModelConfig& config,
                                  const ModelParams& params, const StepBuffers& buf, int64_t rows,
                                  AttendFn attend);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_LAYER_H_
