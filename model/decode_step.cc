#include "model/decode_step.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/cpu_dense_ops.h"

namespace fluxion::model {

absl::StatusOr<std::unique_ptr<DecodeStepRunner>> DecodeStepRunner::Create(const Model& model,
                                                                           DenseOps* ops) {
  FLUXION_ASSIGN_OR_RETURN(ModelParams params, model.UploadParams(*ops));
  return Create(model.config(), ops, std::move(params));
}

std::unique_ptr<DecodeStepRunner> DecodeStepRunner::Create(const ModelConfig& config,
                                                           DenseOps* ops, ModelParams params) {
  return std::unique_ptr<DecodeStepRunner>(new DecodeStepRunner(config, ops, std::move(params)));
}

absl::Status DecodeStepRunner::Step(absl::Span<const int32_t> tokens,
                                    absl::Span<const int64_t> positions,
                                    BatchAttention& attention, float* logits) {
  const ModelConfig& c = config_;
  const int64_t rows = static_cast<int64_t>(tokens.size());
  if (rows == 0) return absl::InvalidArgumentError("a decode step needs at least one request");
  if (positions.size() != tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat("decode step got ", rows, " tokens but ",
                                                   positions.size(), " positions"));
  }
  for (int64_t i = 0; i < rows; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("request ", i, ": token id ", tokens[i],
                                                     " is outside the vocabulary [0, ",
                                                     c.vocab_size, ")"));
    }
    if (positions[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", i, ": position ", positions[i], " is negative"));
    }
  }
  DenseOps& ops = *ops_;
  if (!params_fused_) {
    FLUXION_RETURN_IF_ERROR(FuseParams(ops, &params_));
    params_fused_ = true;
  }
  // The LM head writes into the runner's own buffer when the ops' memory is not the host's, when
  // the ops may record it into a graph (which must not keep the caller's pointer), or when the
  // caller leaves the logits in the ops' memory (no host buffer: the hybrid step's sampling).
  const bool own_logits = !ops.host_memory() || ops.graphs() != nullptr || logits == nullptr;
  if (buf_.capacity < rows) {
    graphs_.clear();  // they record the old buffers' addresses
    FLUXION_ASSIGN_OR_RETURN(buf_, StepBuffers::Create(ops, c, rows));
    logits_.reset();
  }
  if (own_logits && logits_ == nullptr) {
    FLUXION_ASSIGN_OR_RETURN(logits_,
                             ops.Allocate(buf_.capacity * c.vocab_size * sizeof(float)));
  }
  float* out = own_logits ? static_cast<float*>(logits_->data()) : logits;
  EmbedRows(ops, params_, c, buf_, tokens.data(), positions.data(), rows);
  for (int64_t l = 0; l <= c.num_layers; ++l) {
    RunSegment(l, rows, out);
    if (l == c.num_layers) break;
    // No Sync here: an attention on the device keeps the stream full (a per-layer wait cost the
    // HBM step ~20% on the H200); one on the host waits in its CopyToHost. Device errors are
    // sticky and surface at the step's last Sync.
    LayerAttentionIo io;
    io.layer = static_cast<int>(l);
    io.rows = rows;
    io.positions = positions.data();
    io.q = buf_.q;
    io.k = buf_.k;
    io.v = buf_.v;
    io.out = buf_.attn;
    io.host_memory = ops.host_memory();
    FLUXION_RETURN_IF_ERROR(attention.Attend(io));
  }
  if (own_logits && logits != nullptr) {
    ops.CopyToHost(logits, out, rows * c.vocab_size * sizeof(float));
  }
  FLUXION_RETURN_IF_ERROR(ops.Sync());
  if (use_graphs_ && ops.graphs() != nullptr && graph_status_.ok()) graphs_[rows].warmed = true;
  return absl::OkStatus();
}

void DecodeStepRunner::DenseSegment(int64_t s, int64_t rows, float* logits) {
  if (s > 0) PostAttention(*ops_, config_, params_.layers[s - 1], buf_, rows);
  if (s < config_.num_layers) {
    PreAttention(*ops_, config_, params_.layers[s], params_.inv_freq, buf_, rows);
  } else {
    LmHead(*ops_, params_, config_, buf_, buf_.x, rows, logits);
  }
}

void DecodeStepRunner::RunSegment(int64_t s, int64_t rows, float* logits) {
  OpsGraphs* g = ops_->graphs();
  if (!use_graphs_ || g == nullptr || !graph_status_.ok()) return DenseSegment(s, rows, logits);
  if (g->generation() != graph_generation_) {
    graphs_.clear();  // the backend reallocated scratch a graph may have recorded
    graph_generation_ = g->generation();
  }
  auto it = graphs_.find(rows);
  if (it == graphs_.end() || !it->second.warmed) return DenseSegment(s, rows, logits);
  std::vector<std::unique_ptr<OpsGraph>>& segments = it->second.segments;
  if (static_cast<int64_t>(segments.size()) > s) {
    g->Replay(*segments[s]);
    ++graph_replays_;
    return;
  }
  // Segments are recorded in order within a step, so this one is next.
  absl::Status status = g->BeginCapture();
  if (status.ok()) {
    DenseSegment(s, rows, logits);
    absl::StatusOr<std::unique_ptr<OpsGraph>> graph = g->EndCapture();
    if (graph.ok()) {
      g->Replay(**graph);  // recording ran nothing
      segments.push_back(std::move(*graph));
      ++graph_replays_;
      return;
    }
    status = graph.status();
  }
  graph_status_ = absl::Status(status.code(),
                               absl::StrCat("CUDA graphs off for this runner: ", status.message()));
  graphs_.clear();
  DenseSegment(s, rows, logits);
}

HostRows RowsOnHost(const LayerAttentionIo& io, const AttentionShape& shape, DenseOps* ops,
                    std::vector<float>* q, std::vector<float>* k, std::vector<float>* v) {
  if (io.host_memory) return {io.q, io.k, io.v};
  q->resize(io.rows * shape.num_heads * shape.head_dim);
  k->resize(io.rows * shape.num_kv_heads * shape.head_dim);
  v->resize(k->size());
  ops->CopyToHost(q->data(), io.q, q->size() * sizeof(float));
  ops->CopyToHost(k->data(), io.k, k->size() * sizeof(float));
  ops->CopyToHost(v->data(), io.v, v->size() * sizeof(float));
  return {q->data(), k->data(), v->data()};
}

absl::Status SequenceBatchAttention::Attend(const LayerAttentionIo& io) {
  if (io.rows > static_cast<int64_t>(seqs_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("attention for ", io.rows, " rows but ",
                                                   seqs_.size(), " sequences"));
  }
  const int64_t q_row = shape_.num_heads * shape_.head_dim;
  const int64_t kv_row = shape_.num_kv_heads * shape_.head_dim;
  const float *q = io.q, *k = io.k, *v = io.v;
  float* out = io.out;
  if (!io.host_memory && ops_ == nullptr) {
    return absl::FailedPreconditionError(
        "attention over a device DenseOps's rows needs that DenseOps to copy them");
  }
  if (!io.host_memory) {
    const HostRows rows = RowsOnHost(io, shape_, ops_, &q_, &k_, &v_);
    q = rows.q;
    k = rows.k;
    v = rows.v;
    out_.resize(io.rows * q_row);
    out = out_.data();
  }
  for (int64_t i = 0; i < io.rows; ++i) {
    absl::Status s = seqs_[i]->attention().Forward(io.layer, io.positions[i], 1, q + i * q_row,
                                                   k + i * kv_row, v + i * kv_row,
                                                   out + i * q_row);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("request ", i, ", layer ", io.layer, ": ",
                                                 s.message()));
    }
  }
  if (!io.host_memory) ops_->CopyFromHost(io.out, out_.data(), out_.size() * sizeof(float));
  // Every layer now caches the step's token: the sequence holds one more.
  if (io.layer == shape_.num_layers - 1) {
    for (int64_t i = 0; i < io.rows; ++i) seqs_[i]->AdvanceLength(1);
  }
  return absl::OkStatus();
}

absl::Status Model::DecodeStep(absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens,
                               const kernels::cpu::CpuPool* pool,
                               std::vector<float>* logits) const {
  SequenceBatchAttention attention(seqs, attention_shape(), nullptr);
  return DecodeStep(seqs, tokens, attention, pool, logits);
}

absl::Status Model::DecodeStep(absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens,
                               BatchAttention& attention, const kernels::cpu::CpuPool* pool,
                               std::vector<float>* logits) const {
  if (tokens.size() != seqs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("DecodeStep got ", seqs.size(),
                                                   " sequences but ", tokens.size(), " tokens"));
  }
  std::vector<absl::Span<const int32_t>> lists;
  std::vector<int64_t> positions;
  for (size_t i = 0; i < seqs.size(); ++i) {
    lists.push_back(tokens.subspan(i, 1));
    positions.push_back(seqs[i] != nullptr ? seqs[i]->length_ : 0);
  }
  FLUXION_RETURN_IF_ERROR(CheckBatch("DecodeStep", seqs, lists));
  CpuDenseOps ops(pool);
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepRunner> runner,
                           DecodeStepRunner::Create(*this, &ops));
  logits->resize(seqs.size() * config_.vocab_size);
  return runner->Step(tokens, positions, attention, logits->data());
}

}  // namespace fluxion::model
