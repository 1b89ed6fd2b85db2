// A Llama-family decoder-only transformer on the CPU: embeddings, RMSNorm, RoPE (default, linear,
// llama3), GQA/MQA attention through SequenceAttention, SwiGLU MLP, final norm, LM head. Every
// path (Forward, ForwardBatch, the batched decode step of decode_step.h) runs the same layer body
// (layer.h) over DenseOps; Forward and ForwardBatch use the CPU ones (cpu_dense_ops.h).
// Weights are held as fp32 (converted once at load from bf16/fp16/fp32: exact), so results match a
// float32 reference computed from the same saved weights.
//
// Thread-safety: a Model is immutable after Load and may be shared; Forward() calls on different
// Sequences may run concurrently (each uses its own scratch space). Kernels inside one Forward use
// OpenMP/OpenBLAS threads.
#ifndef FLUXION_MODEL_MODEL_H_
#define FLUXION_MODEL_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/attention.h"
#include "model/config.h"
#include "model/dense_ops.h"
#include "model/layer.h"
#include "model/output_projection.h"
#include "model/safetensors.h"

namespace fluxion::model {

class BatchAttention;  // decode_step.h

struct LinearWeights {
  std::vector<float> weight;  // [out][in], as nn.Linear stores it
  std::vector<float> bias;    // [out] or empty
  int64_t out = 0;
  int64_t in = 0;
};

struct LayerWeights {
  std::vector<float> input_norm;  // [hidden]
  LinearWeights q, k, v, o;
  std::vector<float> post_attention_norm;  // [hidden]
  LinearWeights gate, up, down;
};

// One generation stream: its attention state and how many tokens it holds.
class Sequence {
 public:
  explicit Sequence(std::unique_ptr<SequenceAttention> attention)
      : attention_(std::move(attention)) {}
  // Continues a sequence whose `attention` already holds `length` tokens in every layer (e.g. a
  // copy of a prefilled DenseAttention, so that several decodes can share one prefill).
  // REQUIRES: length >= 0 and equals what `attention` holds; a mismatch surfaces as
  // InvalidArgument from the next Forward.
  Sequence(std::unique_ptr<SequenceAttention> attention, int64_t length)
      : attention_(std::move(attention)), length_(length) {}
  int64_t length() const { return length_; }
  // For step drivers outside Model (a BatchAttention that appends the step's K/V itself, e.g.
  // decode/step/paged_batch_attention.h): records that every layer of the attention now holds `n`
  // more tokens. REQUIRES: it does.
  void AdvanceLength(int64_t n) { length_ += n; }
  SequenceAttention& attention() { return *attention_; }
  const SequenceAttention& attention() const { return *attention_; }

 private:
  friend class Model;
  friend class SequenceBatchAttention;  // advances the length after a decode step's last layer
  std::unique_ptr<SequenceAttention> attention_;
  int64_t length_ = 0;
};

class Model {
 public:
  // Loads `dir/config.json` and the checkpoint in `dir`.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& dir);
  // Builds from an already-parsed config (e.g. an alternative config form) and checkpoint.
  // Errors name the missing or mis-shaped tensor.
  static absl::StatusOr<std::unique_ptr<Model>> FromCheckpoint(const ModelConfig& config,
                                                              const Checkpoint& checkpoint);

  const ModelConfig& config() const { return config_; }
  // Parameters held (a tied LM head counted once); fp32 in memory, so 4 bytes each.
  int64_t num_parameters() const { return num_parameters_; }
  AttentionShape attention_shape() const;

  // The weights as ModelParams borrowing this model's host memory (for DenseOps on host memory).
  const ModelParams& host_params() const { return host_params_; }
  // Every layer's o_proj as an OutputProjection borrowing this model's fp32 host weights (the
  // sparse error guard's e_h, decode/sparse/error_guard.h); valid while the model lives.
  OutputProjection output_projection() const;
  // The weights in `ops`'s memory: every matrix through ops.UploadWeight (in the backend's
  // format: the CPU backend borrows the host matrix, CUDA keeps a bf16 copy in HBM); the fp32
  // vectors (norms, biases, RoPE frequencies) borrowed when ops.host_memory(), otherwise copied.
  // The result owns whatever was copied. Errors: the backend's (e.g. ResourceExhausted).
  absl::StatusOr<ModelParams> UploadParams(DenseOps& ops) const;

  // A sequence with the built-in dense fp32 KV cache.
  std::unique_ptr<Sequence> NewSequence() const;

  // Runs `tokens` at positions [seq.length(), seq.length() + tokens.size()) and advances the
  // sequence. Writes the logits of the last token ([vocab_size]) into `*logits`; with
  // `all_logits`, logits of every token ([n][vocab_size]).
  // InvalidArgument for an empty input or a token id outside [0, vocab_size).
  absl::Status Forward(Sequence& seq, absl::Span<const int32_t> tokens, std::vector<float>* logits,
                       bool all_logits = false) const;

  // Forward over several sequences at once (prefill batching): each step stacks up to 512 rows
  // of every unfinished sequence, runs every matrix product (QKV, O, gate/up/down, the LM head of
  // each last row) once over the stacked rows, and RoPE and attention per sequence on its own
  // positions and cache. Each sequence's results equal Forward() on it alone (up to the GEMM's
  // blocking: ~1e-6 relative). Writes the last token's logits of sequence i into (*logits)[i].
  //
  // An error from a sequence's attention (e.g. an attention that checks for cancellation between
  // layers) drops that sequence from the batch: its rows leave every later product, its status
  // goes to (*statuses)[i] (its cache and length are then unspecified, as after a failed
  // Forward), and the others go on unharmed. (*statuses)[i] is OK for every sequence that
  // completed. Returns InvalidArgument naming the sequence (and nothing is computed) when the
  // spans' sizes differ, a sequence is null or listed twice, an input is empty, or an id is
  // outside the vocabulary.
  absl::Status ForwardBatch(absl::Span<Sequence* const> seqs,
                            absl::Span<const absl::Span<const int32_t>> tokens,
                            std::vector<std::vector<float>>* logits,
                            std::vector<absl::Status>* statuses) const;

  // One decode step of many sequences through the batched seam (decode_step.h): tokens[i] at
  // position seqs[i]->length(), one stacked row per sequence, every matrix product once over the
  // batch on the CPU dense ops of `pool` (null: the thread settings in effect), attention per
  // sequence through its SequenceAttention. Writes logits [seqs.size()][vocab_size] and advances
  // every sequence by one token. Each sequence's logits equal Forward() on it alone up to the
  // products' blocking (a GEMM over the rows instead of one GEMV: ~1e-6 relative; bit-identical
  // for one sequence). InvalidArgument, with nothing computed, for the inputs ForwardBatch rejects;
  // an attention error fails the whole step (the caches and lengths are then unspecified).
  absl::Status DecodeStep(absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens,
                          const kernels::cpu::CpuPool* pool, std::vector<float>* logits) const;
  // The same step with the attention of `attention` instead of each sequence's
  // SequenceAttention: it must append each row's K/V to seqs[i]'s cache and advance seqs[i]
  // after the last layer (Sequence::AdvanceLength), as SequenceBatchAttention does.
  absl::Status DecodeStep(absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens,
                          BatchAttention& attention, const kernels::cpu::CpuPool* pool,
                          std::vector<float>* logits) const;

 private:
  Model() = default;
  // InvalidArgument naming the sequence: the checks ForwardBatch and DecodeStep make before
  // computing anything.
  absl::Status CheckBatch(absl::string_view what, absl::Span<Sequence* const> seqs,
                          absl::Span<const absl::Span<const int32_t>> tokens) const;
  ModelConfig config_;
  std::vector<float> embed_;       // [vocab][hidden]
  std::vector<LayerWeights> layers_;
  std::vector<float> final_norm_;  // [hidden]
  std::vector<float> lm_head_;     // [vocab][hidden]; empty when tied to embed_
  std::vector<float> inv_freq_;    // [head_dim / 2], RoPE frequencies after scaling
  ModelParams host_params_;        // pointers into the vectors above
  int64_t num_parameters_ = 0;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_MODEL_H_
