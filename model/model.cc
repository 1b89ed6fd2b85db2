#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/cpu_dense_ops.h"
#include "model/dense_attention.h"
#include "model/rope.h"

namespace fluxion::model {
namespace {

// Prompts are processed in chunks of this many tokens: activations stay bounded (a 32K-token
// prompt on a 0.5B model would otherwise need ~1 GiB of MLP scratch) and the math is unchanged,
// because attention continues from the cache exactly as decode steps do.
constexpr int64_t kPrefillChunk = 512;

// Reads tensors from a checkpoint and remembers which ones were used, so that tensors the config
// does not account for (a checkpoint with q/k/v biases loaded under a config without them) are an
// error instead of being silently dropped.
class TensorReader {
 public:
  explicit TensorReader(const Checkpoint& ckpt) : ckpt_(ckpt) {}

  absl::StatusOr<std::vector<float>> Read(const std::string& name, std::vector<int64_t> shape) {
    FLUXION_ASSIGN_OR_RETURN(const TensorView* t, ckpt_.Find(name));
    used_.insert(name);
    return ReadAsFloat(*t, shape);
  }

  absl::StatusOr<LinearWeights> ReadLinear(const std::string& name, int64_t out, int64_t in,
                                           bool bias) {
    LinearWeights lw;
    lw.out = out;
    lw.in = in;
    FLUXION_ASSIGN_OR_RETURN(lw.weight, Read(name + ".weight", {out, in}));
    if (bias) {
      FLUXION_ASSIGN_OR_RETURN(lw.bias, Read(name + ".bias", {out}));
    }
    return lw;
  }

  // InvalidArgument naming the first unused tensor. Ignored: RoPE buffers some exporters save,
  // and an lm_head saved beside tied embeddings (transformers ignores it too).
  absl::Status CheckAllUsed(const ModelConfig& config) const {
    for (const auto& [name, tensor] : ckpt_.tensors()) {
      if (used_.count(name) || absl::EndsWith(name, "rotary_emb.inv_freq")) continue;
      if (name == "lm_head.weight" && config.tie_word_embeddings) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint tensor '", name, "' is not used by the model config.json describes ",
          "(check attention_bias/mlp_bias, num_hidden_layers and tie_word_embeddings)"));
    }
    return absl::OkStatus();
  }

 private:
  const Checkpoint& ckpt_;
  std::set<std::string> used_;
};

LinearParams ParamsOf(const LinearWeights& w) {
  return {WeightRef{w.weight.data(), WeightDType::kF32}, w.bias.empty() ? nullptr : w.bias.data(),
          w.out, w.in};
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir) {
  FLUXION_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir + "/config.json"));
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(dir));
  return FromCheckpoint(config, *ckpt);
}

absl::StatusOr<std::unique_ptr<Model>> Model::FromCheckpoint(const ModelConfig& config,
                                                            const Checkpoint& ckpt) {
  std::unique_ptr<Model> m(new Model());
  m->config_ = config;
  TensorReader reader(ckpt);
  const int64_t h = config.hidden_size, d = config.head_dim;
  const int64_t q_out = config.num_heads * d, kv_out = config.num_kv_heads * d;
  FLUXION_ASSIGN_OR_RETURN(m->embed_, reader.Read("model.embed_tokens.weight",
                                           {config.vocab_size, h}));
  m->layers_.resize(config.num_layers);
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    LayerWeights& lw = m->layers_[i];
    FLUXION_ASSIGN_OR_RETURN(lw.input_norm, reader.Read(p + "input_layernorm.weight", {h}));
    FLUXION_ASSIGN_OR_RETURN(lw.q, reader.ReadLinear(p + "self_attn.q_proj", q_out, h,
                                              config.qkv_bias));
    FLUXION_ASSIGN_OR_RETURN(lw.k, reader.ReadLinear(p + "self_attn.k_proj", kv_out, h,
                                              config.qkv_bias));
    FLUXION_ASSIGN_OR_RETURN(lw.v, reader.ReadLinear(p + "self_attn.v_proj", kv_out, h,
                                              config.qkv_bias));
    FLUXION_ASSIGN_OR_RETURN(lw.o, reader.ReadLinear(p + "self_attn.o_proj", h, q_out,
                                              config.o_bias));
    FLUXION_ASSIGN_OR_RETURN(lw.post_attention_norm,
                             reader.Read(p + "post_attention_layernorm.weight", {h}));
    const int64_t f = config.intermediate_size;
    FLUXION_ASSIGN_OR_RETURN(lw.gate, reader.ReadLinear(p + "mlp.gate_proj", f, h,
                                                 config.mlp_bias));
    FLUXION_ASSIGN_OR_RETURN(lw.up, reader.ReadLinear(p + "mlp.up_proj", f, h, config.mlp_bias));
    FLUXION_ASSIGN_OR_RETURN(lw.down, reader.ReadLinear(p + "mlp.down_proj", h, f,
                                                 config.mlp_bias));
  }
  FLUXION_ASSIGN_OR_RETURN(m->final_norm_, reader.Read("model.norm.weight", {h}));
  if (!config.tie_word_embeddings) {
    FLUXION_ASSIGN_OR_RETURN(m->lm_head_, reader.Read("lm_head.weight", {config.vocab_size, h}));
  }
  FLUXION_RETURN_IF_ERROR(reader.CheckAllUsed(config));
  m->inv_freq_ = ComputeInvFreq(config.rope, d);
  int64_t n = m->embed_.size() + m->final_norm_.size() + m->lm_head_.size();
  for (const LayerWeights& lw : m->layers_) {
    n += lw.input_norm.size() + lw.post_attention_norm.size();
    for (const LinearWeights* w : {&lw.q, &lw.k, &lw.v, &lw.o, &lw.gate, &lw.up, &lw.down}) {
      n += w->weight.size() + w->bias.size();
    }
  }
  m->num_parameters_ = n;
  ModelParams& p = m->host_params_;
  p.embed = WeightRef{m->embed_.data(), WeightDType::kF32};
  p.final_norm = m->final_norm_.data();
  p.lm_head = m->lm_head_.empty() ? p.embed : WeightRef{m->lm_head_.data(), WeightDType::kF32};
  p.inv_freq = m->inv_freq_.data();
  for (const LayerWeights& lw : m->layers_) {
    p.layers.push_back({lw.input_norm.data(), ParamsOf(lw.q), ParamsOf(lw.k), ParamsOf(lw.v),
                        ParamsOf(lw.o), lw.post_attention_norm.data(), ParamsOf(lw.gate),
                        ParamsOf(lw.up), ParamsOf(lw.down), LinearParams{}, LinearParams{}});
  }
  return m;
}

absl::StatusOr<ModelParams> Model::UploadParams(DenseOps& ops) const {
  ModelParams p;
  p.layers = host_params_.layers;
  // Matrices go through the backend's UploadWeight (its format; the CPU backend borrows). Vectors
  // stay fp32: borrowed on host memory, otherwise copied once each.
  auto upload_matrix = [&](const std::vector<float>& host, int64_t rows,
                           int64_t cols) -> absl::StatusOr<WeightRef> {
    FLUXION_ASSIGN_OR_RETURN(UploadedWeight w, ops.UploadWeight(host.data(), rows, cols));
    if (w.owner != nullptr) p.owned.push_back(std::move(w.owner));
    return w.ref;
  };
  auto upload = [&](const std::vector<float>& host) -> absl::StatusOr<const float*> {
    if (host.empty()) return nullptr;
    if (ops.host_memory()) return host.data();
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<OpsBuffer> buf,
                             ops.Allocate(host.size() * sizeof(float)));
    ops.CopyFromHost(buf->data(), host.data(), host.size() * sizeof(float));
    const float* data = static_cast<const float*>(buf->data());
    p.owned.push_back(std::move(buf));
    return data;
  };
  auto upload_linear = [&](const LinearWeights& w, LinearParams* out) -> absl::Status {
    FLUXION_ASSIGN_OR_RETURN(out->weight, upload_matrix(w.weight, w.out, w.in));
    FLUXION_ASSIGN_OR_RETURN(out->bias, upload(w.bias));
    return absl::OkStatus();
  };
  const int64_t vocab = config_.vocab_size, h = config_.hidden_size;
  FLUXION_ASSIGN_OR_RETURN(p.embed, upload_matrix(embed_, vocab, h));
  FLUXION_ASSIGN_OR_RETURN(p.final_norm, upload(final_norm_));
  if (lm_head_.empty()) {
    p.lm_head = p.embed;  // tied: one copy serves both
  } else {
    FLUXION_ASSIGN_OR_RETURN(p.lm_head, upload_matrix(lm_head_, vocab, h));
  }
  FLUXION_ASSIGN_OR_RETURN(p.inv_freq, upload(inv_freq_));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& lw = layers_[i];
    LayerParams& lp = p.layers[i];
    FLUXION_ASSIGN_OR_RETURN(lp.input_norm, upload(lw.input_norm));
    FLUXION_ASSIGN_OR_RETURN(lp.post_attention_norm, upload(lw.post_attention_norm));
    FLUXION_RETURN_IF_ERROR(upload_linear(lw.q, &lp.q));
    FLUXION_RETURN_IF_ERROR(upload_linear(lw.k, &lp.k));
    FLUXION_RETURN_IF_ERROR(upload_linear(lw.v, &lp.v));
    FLUXION_RETURN_IF_ERROR(upload_linear(lw.o, &lp.o));
    FLUXION_RETURN_IF_ERROR(upload_linear(lw.gate, &lp.gate));
    FLUXION_RETURN_IF_ERROR(upload_linear(lw.up, &lp.up));
    FLUXION_RETURN_IF_ERROR(upload_linear(lw.down, &lp.down));
  }
  FLUXION_RETURN_IF_ERROR(ops.Sync());
  return p;
}

OutputProjection Model::output_projection() const {
  std::vector<const float*> w_o;
  for (const LayerWeights& l : layers_) w_o.push_back(l.o.weight.data());
  return OutputProjection(config_.hidden_size, config_.num_heads * config_.head_dim,
                          std::move(w_o));
}

AttentionShape Model::attention_shape() const {
  return AttentionShape{config_.num_layers, config_.num_heads, config_.num_kv_heads,
                        config_.head_dim,
                        1.0f / std::sqrt(static_cast<float>(config_.head_dim))};
}

std::unique_ptr<Sequence> Model::NewSequence() const {
  return std::make_unique<Sequence>(std::make_unique<DenseAttention>(attention_shape()));
}

absl::Status Model::Forward(Sequence& seq, absl::Span<const int32_t> tokens,
                            std::vector<float>* logits, bool all_logits) const {
  if (tokens.empty()) return absl::InvalidArgumentError("Forward needs at least one token");
  for (int32_t t : tokens) {
    if (t < 0 || t >= config_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", t, " is outside the vocabulary [0, ", config_.vocab_size, ")"));
    }
  }
  const int64_t h = config_.hidden_size, vocab = config_.vocab_size;
  const int64_t total = static_cast<int64_t>(tokens.size());
  if (all_logits) {
    logits->resize(total * vocab);
  } else {
    logits->resize(vocab);
  }

  CpuDenseOps ops;  // host memory, the thread settings in effect
  const int64_t chunk = std::min(total, kPrefillChunk);
  FLUXION_ASSIGN_OR_RETURN(const StepBuffers buf, StepBuffers::Create(ops, config_, chunk));
  std::vector<int64_t> positions(chunk);

  for (int64_t c0 = 0; c0 < total; c0 += chunk) {
    const int64_t n = std::min(chunk, total - c0);
    const int64_t pos0 = seq.length_;
    for (int64_t i = 0; i < n; ++i) positions[i] = pos0 + i;
    EmbedRows(ops, host_params_, config_, buf, tokens.data() + c0, positions.data(), n);
    auto attend = [&](int layer, int64_t rows) -> absl::StatusOr<int64_t> {
      FLUXION_RETURN_IF_ERROR(
          seq.attention_->Forward(layer, pos0, rows, buf.q, buf.k, buf.v, buf.attn));
      return rows;
    };
    FLUXION_RETURN_IF_ERROR(RunLayers(ops, config_, host_params_, buf, n, attend).status());
    seq.length_ += n;
    if (all_logits) {
      LmHead(ops, host_params_, config_, buf, buf.x, n, logits->data() + c0 * vocab);
    } else if (c0 + n == total) {
      LmHead(ops, host_params_, config_, buf, buf.x + (n - 1) * h, 1, logits->data());
    }
  }
  return absl::OkStatus();
}

absl::Status Model::CheckBatch(absl::string_view what, absl::Span<Sequence* const> seqs,
                              absl::Span<const absl::Span<const int32_t>> tokens) const {
  const size_t b = seqs.size();
  if (b == 0) return absl::InvalidArgumentError(absl::StrCat(what, " needs at least one sequence"));
  if (tokens.size() != b) {
    return absl::InvalidArgumentError(absl::StrCat(what, " got ", b, " sequences but ",
                                                   tokens.size(), " token lists"));
  }
  std::set<const Sequence*> seen;
  for (size_t i = 0; i < b; ++i) {
    if (seqs[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, " is null"));
    }
    if (!seen.insert(seqs[i]).second) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, " is listed twice"));
    }
    if (tokens[i].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", i, ": Forward needs at least one token"));
    }
    for (size_t j = 0; j < tokens[i].size(); ++j) {
      const int32_t t = tokens[i][j];
      if (t < 0 || t >= config_.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", i, ": token id ", t, " at index ", j,
                         " is outside the vocabulary [0, ", config_.vocab_size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Model::ForwardBatch(absl::Span<Sequence* const> seqs,
                                 absl::Span<const absl::Span<const int32_t>> tokens,
                                 std::vector<std::vector<float>>* logits,
                                 std::vector<absl::Status>* statuses) const {
  FLUXION_RETURN_IF_ERROR(CheckBatch("ForwardBatch", seqs, tokens));
  const size_t b = seqs.size();
  const int64_t h = config_.hidden_size, d = config_.head_dim;
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads, vocab = config_.vocab_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  logits->assign(b, {});
  statuses->assign(b, absl::OkStatus());

  int64_t max_rows = 0;
  for (size_t i = 0; i < b; ++i) {
    max_rows += std::min<int64_t>(static_cast<int64_t>(tokens[i].size()), kPrefillChunk);
  }
  CpuDenseOps ops;  // host memory, the thread settings in effect
  FLUXION_ASSIGN_OR_RETURN(const StepBuffers buf, StepBuffers::Create(ops, config_, max_rows));
  std::vector<float> head_logits;
  std::vector<int32_t> step_tokens(max_rows);
  std::vector<int64_t> positions(max_rows);
  std::vector<int64_t> done(b, 0);  // tokens of each sequence already run
  std::vector<size_t> active(b);
  for (size_t i = 0; i < b; ++i) active[i] = i;

  // One part per sequence in a step: its rows [row0, row0 + n) of the stacked activations.
  struct Part {
    size_t seq;
    int64_t row0, n, pos0;
  };
  while (!active.empty()) {
    std::vector<Part> parts;
    int64_t rows = 0;
    for (size_t i : active) {
      const int64_t n =
          std::min<int64_t>(kPrefillChunk, static_cast<int64_t>(tokens[i].size()) - done[i]);
      parts.push_back({i, rows, n, seqs[i]->length_});
      for (int64_t r = 0; r < n; ++r) {
        step_tokens[rows + r] = tokens[i][done[i] + r];
        positions[rows + r] = seqs[i]->length_ + r;
      }
      rows += n;
    }
    EmbedRows(ops, host_params_, config_, buf, step_tokens.data(), positions.data(), rows);
    // Attention per part on its own cache. An error drops that sequence: the live activations
    // (the residual stream, the attention output and the positions) are compacted over its rows,
    // survivors keeping their order, and the layers go on with the rest.
    auto attend = [&](int layer, int64_t live) -> absl::StatusOr<int64_t> {
      bool dropped = false;
      for (Part& p : parts) {
        absl::Status s = seqs[p.seq]->attention_->Forward(
            layer, p.pos0, p.n, buf.q + p.row0 * hq * d, buf.k + p.row0 * hkv * d,
            buf.v + p.row0 * hkv * d, buf.attn + p.row0 * hq * d);
        if (!s.ok()) {
          (*statuses)[p.seq] = std::move(s);
          dropped = true;
        }
      }
      if (!dropped) return live;
      std::vector<Part> kept;
      int64_t at = 0;
      for (const Part& p : parts) {
        if (!(*statuses)[p.seq].ok()) continue;
        if (at != p.row0) {
          ops.Copy(buf.x + at * h, buf.x + p.row0 * h, p.n * h * sizeof(float));
          ops.Copy(buf.attn + at * hq * d, buf.attn + p.row0 * hq * d,
                   p.n * hq * d * sizeof(float));
          ops.Copy(buf.positions + at, buf.positions + p.row0, p.n * sizeof(int64_t));
        }
        kept.push_back({p.seq, at, p.n, p.pos0});
        at += p.n;
      }
      parts = std::move(kept);
      return at;
    };
    FLUXION_RETURN_IF_ERROR(RunLayers(ops, config_, host_params_, buf, rows, attend).status());
    // The LM head over the last rows of the sequences that end in this step, in one product.
    std::vector<size_t> finishing;
    int64_t m = 0;
    for (const Part& p : parts) {
      seqs[p.seq]->length_ += p.n;
      done[p.seq] += p.n;
      if (done[p.seq] == static_cast<int64_t>(tokens[p.seq].size())) {
        ops.RmsNorm(buf.x + (p.row0 + p.n - 1) * h, host_params_.final_norm, eps,
                    buf.normed + m * h, 1, h);
        finishing.push_back(p.seq);
        ++m;
      }
    }
    if (m > 0) {
      head_logits.resize(m * vocab);
      ops.MatMul(buf.normed, host_params_.lm_head, nullptr, head_logits.data(), m, vocab, h,
                 false);
      for (int64_t j = 0; j < m; ++j) {
        (*logits)[finishing[j]].assign(head_logits.begin() + j * vocab,
                                       head_logits.begin() + (j + 1) * vocab);
      }
    }
    std::vector<size_t> next;
    for (const Part& p : parts) {
      if (done[p.seq] < static_cast<int64_t>(tokens[p.seq].size())) next.push_back(p.seq);
    }
    active = std::move(next);
  }
  return absl::OkStatus();
}

}  // namespace fluxion::model
