#include "model/layer.h"

#include "common/status_macros.h"

namespace fluxion::model {
namespace {

void Linear(DenseOps& ops, const LinearParams& w, const float* x, float* y, int64_t m,
            bool accumulate) {
  ops.MatMul(x, w.weight, w.bias, y, m, w.out, w.in, accumulate);
}

}  // namespace

absl::StatusOr<StepBuffers> StepBuffers::Create(DenseOps& ops, const ModelConfig& c,
                                                int64_t capacity) {
  StepBuffers b;
  b.capacity = capacity;
  const int64_t rows = std::max<int64_t>(capacity, 1);
  auto alloc = [&](size_t bytes) -> absl::StatusOr<void*> {
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<OpsBuffer> buffer, ops.Allocate(bytes));
    void* data = buffer->data();
    b.owned_.push_back(std::move(buffer));
    return data;
  };
  auto floats = [&](int64_t per_row) -> absl::StatusOr<float*> {
    FLUXION_ASSIGN_OR_RETURN(void* p, alloc(rows * per_row * sizeof(float)));
    return static_cast<float*>(p);
  };
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  FLUXION_ASSIGN_OR_RETURN(b.x, floats(h));
  FLUXION_ASSIGN_OR_RETURN(b.normed, floats(h));
  FLUXION_ASSIGN_OR_RETURN(b.q, floats(q));
  FLUXION_ASSIGN_OR_RETURN(b.k, floats(kv));
  FLUXION_ASSIGN_OR_RETURN(b.v, floats(kv));
  FLUXION_ASSIGN_OR_RETURN(b.attn, floats(q));
  FLUXION_ASSIGN_OR_RETURN(b.gate, floats(c.intermediate_size));
  FLUXION_ASSIGN_OR_RETURN(b.up, floats(c.intermediate_size));
  FLUXION_ASSIGN_OR_RETURN(void* positions, alloc(rows * sizeof(int64_t)));
  b.positions = static_cast<int64_t*>(positions);
  FLUXION_ASSIGN_OR_RETURN(void* tokens, alloc(rows * sizeof(int32_t)));
  b.tokens = static_cast<int32_t*>(tokens);
  return b;
}

void EmbedRows(DenseOps& ops, const ModelParams& params, const ModelConfig& c,
               const StepBuffers& buf, const int32_t* host_tokens, const int64_t* host_positions,
               int64_t rows) {
  ops.CopyFromHost(buf.tokens, host_tokens, rows * sizeof(int32_t));
  ops.CopyFromHost(buf.positions, host_positions, rows * sizeof(int64_t));
  ops.GatherRows(params.embed, buf.tokens, rows, c.hidden_size, buf.x);
}

void PreAttention(DenseOps& ops, const ModelConfig& c, const LayerParams& w,
                  const float* inv_freq, const StepBuffers& buf, int64_t rows) {
  const float eps = static_cast<float>(c.rms_norm_eps);
  ops.RmsNorm(buf.x, w.input_norm, eps, buf.normed, rows, c.hidden_size);
  Linear(ops, w.q, buf.normed, buf.q, rows, false);
  Linear(ops, w.k, buf.normed, buf.k, rows, false);
  Linear(ops, w.v, buf.normed, buf.v, rows, false);
  ops.ApplyRope(buf.q, buf.positions, inv_freq, rows, c.num_heads, c.head_dim);
  ops.ApplyRope(buf.k, buf.positions, inv_freq, rows, c.num_kv_heads, c.head_dim);
}

void PostAttention(DenseOps& ops, const ModelConfig& c, const LayerParams& w,
                   const StepBuffers& buf, int64_t rows) {
  const float eps = static_cast<float>(c.rms_norm_eps);
  Linear(ops, w.o, buf.attn, buf.x, rows, /*accumulate=*/true);  // residual
  ops.RmsNorm(buf.x, w.post_attention_norm, eps, buf.normed, rows, c.hidden_size);
  Linear(ops, w.gate, buf.normed, buf.gate, rows, false);
  Linear(ops, w.up, buf.normed, buf.up, rows, false);
  ops.SiluMul(buf.gate, buf.up, buf.gate, rows * c.intermediate_size);
  Linear(ops, w.down, buf.gate, buf.x, rows, /*accumulate=*/true);  // residual
}

void LmHead(DenseOps& ops, const ModelParams& params, const ModelConfig& c,
            const StepBuffers& buf, const float* x_rows, int64_t n, float* logits) {
  ops.RmsNorm(x_rows, params.final_norm, static_cast<float>(c.rms_norm_eps), buf.normed, n,
              c.hidden_size);
  ops.MatMul(buf.normed, params.lm_head, nullptr, logits, n, c.vocab_size, c.hidden_size, false);
}

absl::StatusOr<int64_t> RunLayers(DenseOps& ops, const ModelConfig& c, const ModelParams& params,
                                  const StepBuffers& buf, int64_t rows, AttendFn attend) {
  for (int64_t l = 0; l < c.num_layers && rows > 0; ++l) {
    const LayerParams& w = params.layers[l];
    PreAttention(ops, c, w, params.inv_freq, buf, rows);
    FLUXION_ASSIGN_OR_RETURN(rows, attend(static_cast<int>(l), rows));
    if (rows == 0) break;
    PostAttention(ops, c, w, buf, rows);
  }
  return rows;
}

}  // namespace fluxion::model
