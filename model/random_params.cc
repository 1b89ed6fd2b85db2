#include "model/random_params.h"

#include <cmath>
#include <memory>
#include <vector>

#include "common/status_macros.h"
#include "model/rope.h"

namespace fluxion::model {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Element i of stream `stream`: uniform in [-amplitude, amplitude), the same for any thread count.
void FillUniform(float* data, int64_t n, uint64_t stream, float amplitude,
                 const kernels::cpu::CpuPool* pool) {
  constexpr int64_t kChunk = 1 << 16;
  auto chunk = [&](int64_t c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) {
      const uint64_t r = SplitMix64(stream * 0x100000001b3ull + static_cast<uint64_t>(i));
      data[i] = amplitude * (static_cast<float>(r >> 40) * (2.0f / 16777216.0f) - 1.0f);
    }
  };
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (pool == nullptr) {
    for (int64_t c = 0; c < chunks; ++c) chunk(c);
  } else {
    pool->ParallelFor(chunks, chunk);
  }
}

class Maker {
 public:
  Maker(DenseOps& ops, uint64_t seed, const kernels::cpu::CpuPool* pool, ModelParams* params)
      : ops_(ops), seed_(seed), pool_(pool), params_(params) {}

  // `n` values uniform with variance `variance` (0: all `constant`), in the backend's memory.
  absl::StatusOr<const float*> Make(int64_t n, float variance, float constant = 0.0f) {
    host_.assign(n, constant);
    if (variance > 0) FillUniform(host_.data(), n, NextStream(), std::sqrt(3 * variance), pool_);
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<OpsBuffer> buf, ops_.Allocate(n * sizeof(float)));
    ops_.CopyFromHost(buf->data(), host_.data(), n * sizeof(float));
    const float* data = static_cast<const float*>(buf->data());
    params_->owned.push_back(std::move(buf));
    return data;
  }

  // A weight matrix [rows][cols] uniform with variance 1/cols, in the backend's format. On host
  // memory the matrix is made in a buffer the params own and the backend borrows it; elsewhere it
  // is made in host scratch and uploaded (the backend converts it, e.g. to bf16 in HBM).
  absl::StatusOr<WeightRef> Matrix(int64_t rows, int64_t cols, float variance) {
    const int64_t n = rows * cols;
    const float amplitude = std::sqrt(3 * variance);
    if (ops_.host_memory()) {
      FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<OpsBuffer> buf, ops_.Allocate(n * sizeof(float)));
      FillUniform(static_cast<float*>(buf->data()), n, NextStream(), amplitude, pool_);
      FLUXION_ASSIGN_OR_RETURN(UploadedWeight w,
                               ops_.UploadWeight(static_cast<const float*>(buf->data()), rows,
                                                 cols));
      params_->owned.push_back(std::move(buf));
      if (w.owner != nullptr) params_->owned.push_back(std::move(w.owner));
      return w.ref;
    }
    host_.resize(n);
    FillUniform(host_.data(), n, NextStream(), amplitude, pool_);
    FLUXION_ASSIGN_OR_RETURN(UploadedWeight w, ops_.UploadWeight(host_.data(), rows, cols));
    if (w.owner == nullptr) {
      return absl::InternalError("a device DenseOps borrowed a host matrix it cannot read");
    }
    params_->owned.push_back(std::move(w.owner));
    return w.ref;
  }

  absl::Status Linear(int64_t out, int64_t in, bool bias, LinearParams* p) {
    p->out = out;
    p->in = in;
    FLUXION_ASSIGN_OR_RETURN(p->weight, Matrix(out, in, 1.0f / static_cast<float>(in)));
    if (bias) {
      FLUXION_ASSIGN_OR_RETURN(p->bias, Make(out, 0.01f));
    }
    return absl::OkStatus();
  }

 private:
  uint64_t NextStream() { return seed_ * 1000003 + stream_++; }

  DenseOps& ops_;
  const uint64_t seed_;
  const kernels::cpu::CpuPool* const pool_;
  ModelParams* const params_;
  uint64_t stream_ = 0;
  std::vector<float> host_;
};

}  // namespace

absl::StatusOr<ModelParams> RandomParams(const ModelConfig& c, DenseOps& ops, uint64_t seed,
                                         const kernels::cpu::CpuPool* pool) {
  ModelParams p;
  Maker make(ops, seed, pool, &p);
  const int64_t h = c.hidden_size, d = c.head_dim, f = c.intermediate_size;
  FLUXION_ASSIGN_OR_RETURN(p.embed, make.Matrix(c.vocab_size, h, 1.0f));
  p.layers.resize(c.num_layers);
  for (LayerParams& l : p.layers) {
    FLUXION_ASSIGN_OR_RETURN(l.input_norm, make.Make(h, 0.0f, 1.0f));
    FLUXION_RETURN_IF_ERROR(make.Linear(c.num_heads * d, h, c.qkv_bias, &l.q));
    FLUXION_RETURN_IF_ERROR(make.Linear(c.num_kv_heads * d, h, c.qkv_bias, &l.k));
    FLUXION_RETURN_IF_ERROR(make.Linear(c.num_kv_heads * d, h, c.qkv_bias, &l.v));
    FLUXION_RETURN_IF_ERROR(make.Linear(h, c.num_heads * d, false, &l.o));
    FLUXION_ASSIGN_OR_RETURN(l.post_attention_norm, make.Make(h, 0.0f, 1.0f));
    FLUXION_RETURN_IF_ERROR(make.Linear(f, h, false, &l.gate));
    FLUXION_RETURN_IF_ERROR(make.Linear(f, h, false, &l.up));
    FLUXION_RETURN_IF_ERROR(make.Linear(h, f, false, &l.down));
  }
  FLUXION_ASSIGN_OR_RETURN(p.final_norm, make.Make(h, 0.0f, 1.0f));
  if (c.tie_word_embeddings) {
    p.lm_head = p.embed;
  } else {
    FLUXION_ASSIGN_OR_RETURN(p.lm_head, make.Matrix(c.vocab_size, h, 1.0f / h));
  }
  // inv_freq: the model's real RoPE frequencies.
  const std::vector<float> inv_freq = ComputeInvFreq(c.rope, d);
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<OpsBuffer> buf,
                           ops.Allocate(inv_freq.size() * sizeof(float)));
  ops.CopyFromHost(buf->data(), inv_freq.data(), inv_freq.size() * sizeof(float));
  p.inv_freq = static_cast<const float*>(buf->data());
  p.owned.push_back(std::move(buf));
  return p;
}

}  // namespace fluxion::model
