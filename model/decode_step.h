// The batched decode step: the entry point a decode step executor calls once per step for all the
// requests it runs (docs/EXECUTOR.md). One row per request, each at its own position:
//
//   embed the batch's tokens
//   for each layer:  PreAttention over all rows          (DenseOps: one product per weight)
//                    attention.Attend(layer, q, k, v)     (the executor: append K/V, select,
//                                                          attend, merge -> out)
//                    PostAttention over all rows          (DenseOps)
//   final norm + LM head over all rows -> logits
//
// The dense halves run on a DenseOps (CPU or CUDA); the attention is the executor's, so that a
// hybrid step can attend the resident part on the GPU and the selected host pages on the CPU
// (kernels/attention_backend.h) and merge the two by log-sum-exp.
//
// On a DenseOps that offers fused operations (dense_ops.h FusedDenseOps) the runner stacks the
// weights at its first step (FuseParams) and the layers run fused. On one that offers graphs
// (OpsGraphs) the dense work between two attentions -- PostAttention(l - 1) + PreAttention(l), the
// first PreAttention, the last PostAttention + LM head: num_layers + 1 segments -- is recorded as
// one graph per segment and batch size and replayed; the attention between them stays the
// executor's, launched as before (its launch sizes change as the contexts grow, which a graph
// could not follow). The first step at a batch size runs eagerly (the backend's scratch and its
// GEMM choices settle), the second records, later ones replay. A graph is invalidated when the
// step buffers are reallocated (a larger batch than any before) or the backend reallocates its
// scratch (OpsGraphs::generation); a failed capture turns graphs off for the runner
// (graph_status) and the step runs eagerly.
//
// Thread-compatible: one driver thread per runner.
#ifndef FLUXION_MODEL_DECODE_STEP_H_
#define FLUXION_MODEL_DECODE_STEP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/dense_ops.h"
#include "model/layer.h"
#include "model/model.h"

namespace fluxion::model {

// What the executor sees of one layer between its dense halves. Row i is request i of the step.
struct LayerAttentionIo {
  int layer = 0;
  int64_t rows = 0;
  const int64_t* positions = nullptr;  // host [rows]: row i's token is at positions[i], so its
                                       // context after appending is positions[i] + 1 tokens
  // In the DenseOps's memory (host memory only when host_memory):
  const float* q = nullptr;  // [rows][num_heads][head_dim], post-RoPE, unscaled
  const float* k = nullptr;  // [rows][num_kv_heads][head_dim], post-RoPE
  const float* v = nullptr;  // [rows][num_kv_heads][head_dim]
  float* out = nullptr;      // [rows][num_heads][head_dim]: to be written, every row
  bool host_memory = true;
};

// The layer's q/k/v rows readable on the host: io's own pointers when io.host_memory, else copies
// made through `ops` into the three vectors (grown as needed; the copies wait for the device).
// REQUIRES: ops non-null when !io.host_memory.
struct HostRows {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
};
HostRows RowsOnHost(const LayerAttentionIo& io, const AttentionShape& shape, DenseOps* ops,
                    std::vector<float>* q, std::vector<float>* k, std::vector<float>* v);

// The executor's half of a layer. Implementations append each row's K/V to its request's cache
// (at positions[i]) and write its attention output; they may copy q/k/v to the host (through the
// DenseOps) to attend there. An error fails the whole step.
class BatchAttention {
 public:
  virtual ~BatchAttention() = default;
  virtual absl::Status Attend(const LayerAttentionIo& io) = 0;
};

class DecodeStepRunner {
 public:
  // `model` and `ops` must outlive the runner. The weights come from model.UploadParams(*ops):
  // borrowed for host DenseOps, uploaded once otherwise.
  static absl::StatusOr<std::unique_ptr<DecodeStepRunner>> Create(const Model& model,
                                                                  DenseOps* ops);
  // A runner over weights already in `ops`'s memory (e.g. random_params.h's, for shapes whose
  // host copy would not fit). REQUIRES: `params` match `config`.
  static std::unique_ptr<DecodeStepRunner> Create(const ModelConfig& config, DenseOps* ops,
                                                  ModelParams params);

  // Runs one step: tokens[i] at positions[i] for every request i; writes logits
  // [tokens.size()][vocab_size] into host memory, or, when `logits` is null, leaves them in the
  // ops' memory (ops_logits()). Buffers grow to the largest batch seen.
  // InvalidArgument (nothing computed) for an empty batch, mismatched sizes, a token id outside
  // the vocabulary or a negative position; otherwise the first error of `attention` or of the
  // DenseOps.
  absl::Status Step(absl::Span<const int32_t> tokens, absl::Span<const int64_t> positions,
                    BatchAttention& attention, float* logits);

  DenseOps& ops() { return *ops_; }
  // The last Step's logits [rows][vocab_size] in the ops' memory, when that Step was given no host
  // buffer (null before any); valid until the next Step.
  const float* ops_logits() const {
    return logits_ != nullptr ? static_cast<const float*>(logits_->data()) : nullptr;
  }
  const ModelParams& params() const { return params_; }

  // Graphs on (the default, where the ops offer them) or off: the same results either way.
  void set_use_graphs(bool on) {
    use_graphs_ = on;
    graphs_.clear();
  }
  // Why graphs were turned off (a failed capture); OK otherwise.
  const absl::Status& graph_status() const { return graph_status_; }
  // Dense segments run from graphs so far (recorded and replayed, or replayed).
  int64_t graph_replays() const { return graph_replays_; }

 private:
  DecodeStepRunner(const ModelConfig& config, DenseOps* ops, ModelParams params)
      : config_(config), ops_(ops), params_(std::move(params)) {}

  // Segment s of a step's dense work over `rows` rows: PostAttention(s - 1) when s > 0, then
  // PreAttention(s) when s < num_layers, else the LM head into `logits` (backend memory).
  void DenseSegment(int64_t s, int64_t rows, float* logits);
  // DenseSegment from a graph when one can serve (recording it first when due), else eagerly.
  void RunSegment(int64_t s, int64_t rows, float* logits);

  const ModelConfig config_;
  DenseOps* ops_;
  ModelParams params_;
  bool params_fused_ = false;  // FuseParams has run (at the first step)
  StepBuffers buf_;
  std::unique_ptr<OpsBuffer> logits_;  // [capacity][vocab] unless the LM head writes the caller's

  struct SizeGraphs {
    bool warmed = false;  // a step at this size has run eagerly
    std::vector<std::unique_ptr<OpsGraph>> segments;  // recorded so far, in segment order
  };
  bool use_graphs_ = true;
  absl::Status graph_status_;
  uint64_t graph_generation_ = 0;            // the ops' generation the graphs were recorded at
  std::map<int64_t, SizeGraphs> graphs_;     // by batch size
  int64_t graph_replays_ = 0;
};

// BatchAttention over Sequences: row i attends through seqs[i]'s SequenceAttention (one token at
// positions[i]), copying q/k/v to the host and the output back when the DenseOps's memory is not
// host memory. Errors name the request. After the last layer's attention each sequence's length
// grows by one (its caches then hold the step's token). The per-request path the decode node
// runs today, behind the batched seam.
class SequenceBatchAttention : public BatchAttention {
 public:
  // `seqs` and `ops` must outlive this; shape from the model. `ops` may be null when the rows
  // are in host memory (a host DenseOps).
  SequenceBatchAttention(absl::Span<Sequence* const> seqs, const AttentionShape& shape,
                         DenseOps* ops)
      : seqs_(seqs), shape_(shape), ops_(ops) {}
  absl::Status Attend(const LayerAttentionIo& io) override;

 private:
  absl::Span<Sequence* const> seqs_;
  AttentionShape shape_;
  DenseOps* ops_;
  std::vector<float> q_, k_, v_, out_;  // host copies when the ops' memory is not the host's
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_DECODE_STEP_H_
