#include "model/layer.h"

#include <algorithm>
#include <initializer_list>

#include "common/status_macros.h"

namespace fluxion::model {
namespace {

void Linear(DenseOps& ops, const LinearParams& w, const float* x, float* y, int64_t m,
            bool accumulate) {
  ops.MatMul(x, w.weight, w.bias, y, m, w.out, w.in, accumulate);
}

size_t ElementBytes(WeightDType t) { return t == WeightDType::kBF16 ? 2 : 4; }

// Frees the buffer `params` owns at `data`, if it owns one there (a borrowed host pointer is not).
void Release(ModelParams* params, const void* data) {
  auto& owned = params->owned;
  auto at_data = [&](const std::unique_ptr<OpsBuffer>& b) { return b->data() == data; };
  owned.erase(std::remove_if(owned.begin(), owned.end(), at_data), owned.end());
}

// One LinearParams whose rows are `parts`' rows in order (same `in`, same dtype, every part with a
// bias or none), made on the device; each part then views its rows of the stack and its own copy
// is freed. Leaves *stacked empty when the parts cannot be stacked.
absl::Status Stack(DenseOps& ops, std::initializer_list<LinearParams*> parts,
                   ModelParams* params, LinearParams* stacked) {
  const LinearParams& first = **parts.begin();
  int64_t rows = 0, with_bias = 0;
  for (const LinearParams* p : parts) {
    if (p->in != first.in || p->weight.dtype != first.weight.dtype || p->weight.data == nullptr) {
      return absl::OkStatus();
    }
    rows += p->out;
    with_bias += p->bias != nullptr;
  }
  if (with_bias != 0 && with_bias != static_cast<int64_t>(parts.size())) return absl::OkStatus();
  const size_t row_bytes = first.in * ElementBytes(first.weight.dtype);
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<OpsBuffer> weight, ops.Allocate(rows * row_bytes));
  std::unique_ptr<OpsBuffer> bias;
  if (with_bias != 0) {
    FLUXION_ASSIGN_OR_RETURN(bias, ops.Allocate(rows * sizeof(float)));
  }
  char* w = static_cast<char*>(weight->data());
  float* b = bias != nullptr ? static_cast<float*>(bias->data()) : nullptr;
  for (LinearParams* p : parts) {
    ops.Copy(w, p->weight.data, p->out * row_bytes);
    if (b != nullptr) ops.Copy(b, p->bias, p->out * sizeof(float));
    // The copies must have run before the originals are freed.
    FLUXION_RETURN_IF_ERROR(ops.Sync());
    Release(params, p->weight.data);
    p->weight.data = w;
    w += p->out * row_bytes;
    if (b != nullptr) {
      Release(params, p->bias);
      p->bias = b;
      b += p->out;
    }
  }
  stacked->weight = WeightRef{weight->data(), first.weight.dtype};
  stacked->bias = bias != nullptr ? static_cast<const float*>(bias->data()) : nullptr;
  stacked->out = rows;
  stacked->in = first.in;
  params->owned.push_back(std::move(weight));
  if (bias != nullptr) params->owned.push_back(std::move(bias));
  return absl::OkStatus();
}

// The one place that decides fused vs plain: the backend offers fused ops, the buffers were made
// for them, and this layer's weights were stacked.
FusedDenseOps* FusedFor(DenseOps& ops, const LinearParams& stacked, const StepBuffers& buf) {
  FusedDenseOps* f = ops.fused();
  return f != nullptr && buf.gemm_input != nullptr && stacked.weight.data != nullptr ? f : nullptr;
}

void FusedPreAttention(FusedDenseOps& f, const ModelConfig& c, const LayerParams& w,
                       const float* inv_freq, const StepBuffers& buf, int64_t rows) {
  f.RmsNormToGemmInput(buf.x, w.input_norm, static_cast<float>(c.rms_norm_eps), buf.gemm_input,
                       rows, c.hidden_size);
  f.MatMulGemmInput(buf.gemm_input, w.qkv.weight, nullptr, buf.qkv, rows, w.qkv.out, w.qkv.in,
                    false);
  f.SplitQkvRope(buf.qkv, w.qkv.bias, buf.positions, inv_freq, buf.q, buf.k, buf.v, rows,
                 c.num_heads, c.num_kv_heads, c.head_dim);
}

void FusedPostAttention(FusedDenseOps& f, const ModelConfig& c, const LayerParams& w,
                        const StepBuffers& buf, int64_t rows) {
  f.ToGemmInput(buf.attn, buf.gemm_input, rows * w.o.in);
  f.MatMulGemmInput(buf.gemm_input, w.o.weight, w.o.bias, buf.x, rows, w.o.out, w.o.in,
                    /*accumulate=*/true);  // residual
  f.RmsNormToGemmInput(buf.x, w.post_attention_norm, static_cast<float>(c.rms_norm_eps),
                       buf.gemm_input, rows, c.hidden_size);
  f.MatMulGemmInput(buf.gemm_input, w.gate_up.weight, w.gate_up.bias, buf.gate_up, rows,
                    w.gate_up.out, w.gate_up.in, false);
  f.SiluMulToGemmInput(buf.gate_up, buf.gemm_input, rows, c.intermediate_size);
  f.MatMulGemmInput(buf.gemm_input, w.down.weight, w.down.bias, buf.x, rows, w.down.out,
                    w.down.in, /*accumulate=*/true);  // residual
}

}  // namespace

absl::Status FuseParams(DenseOps& ops, ModelParams* params) {
  if (ops.fused() == nullptr) return absl::OkStatus();
  for (LayerParams& l : params->layers) {
    if (l.qkv.weight.data == nullptr) {
      FLUXION_RETURN_IF_ERROR(Stack(ops, {&l.q, &l.k, &l.v}, params, &l.qkv));
    }
    if (l.gate_up.weight.data == nullptr) {
      FLUXION_RETURN_IF_ERROR(Stack(ops, {&l.gate, &l.up}, params, &l.gate_up));
    }
  }
  return ops.Sync();
}

ModelParams BorrowParams(const ModelParams& owner) {
  ModelParams view;
  view.embed = owner.embed;
  view.layers = owner.layers;
  view.final_norm = owner.final_norm;
  view.lm_head = owner.lm_head;
  view.inv_freq = owner.inv_freq;
  return view;
}

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
  if (FusedDenseOps* f = ops.fused(); f != nullptr) {
    const int64_t widest = std::max({h, q, c.intermediate_size});
    FLUXION_ASSIGN_OR_RETURN(b.gemm_input, alloc(f->GemmInputBytes(rows * widest)));
    FLUXION_ASSIGN_OR_RETURN(b.qkv, floats(q + 2 * kv));
    FLUXION_ASSIGN_OR_RETURN(b.gate_up, floats(2 * c.intermediate_size));
  }
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
  if (FusedDenseOps* f = FusedFor(ops, w.qkv, buf); f != nullptr) {
    return FusedPreAttention(*f, c, w, inv_freq, buf, rows);
  }
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
  if (FusedDenseOps* f = FusedFor(ops, w.gate_up, buf); f != nullptr) {
    return FusedPostAttention(*f, c, w, buf, rows);
  }
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
  if (FusedDenseOps* f = ops.fused(); f != nullptr && buf.gemm_input != nullptr) {
    f->RmsNormToGemmInput(x_rows, params.final_norm, static_cast<float>(c.rms_norm_eps),
                          buf.gemm_input, n, c.hidden_size);
    f->MatMulGemmInput(buf.gemm_input, params.lm_head, nullptr, logits, n, c.vocab_size,
                       c.hidden_size, false);
    return;
  }
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
