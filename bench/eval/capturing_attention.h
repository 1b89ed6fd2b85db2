// A SequenceAttention decorator that records what sparse-policy calibration needs: the post-RoPE
// query rows of chosen positions and, for each recorded row and head, statistics of its full
// attention distribution (sink mass, local-window mass, entropy). Outputs and errors of the wrapped
// attention pass through untouched, so wrapping changes no generated token.
//
// The statistics are over the *full* distribution (softmax of q.k over every earlier key) even when
// the wrapped attention is a sparse policy: they say where a head's mass really is, which is what a
// policy is calibrated against. The decorator therefore keeps its own copy of every key (fp32,
// [length][kv_heads][head_dim] per layer); a decorator over a copied prefill gets the prefill's
// keys through `prefix`.
//
// Thread-compatible, like every SequenceAttention (one sequence, one driver thread); the statistics
// themselves are computed with OpenMP threads over heads.
#ifndef FLUXION_BENCH_EVAL_CAPTURING_ATTENTION_H_
#define FLUXION_BENCH_EVAL_CAPTURING_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "model/attention.h"
#include "model/dense_attention.h"

namespace fluxion::eval {

struct CaptureOptions {
  int64_t capture_from = 0;   // record query rows at positions >= this
  int64_t sink_tokens = 4;    // sink mass: positions [0, sink_tokens)
  int64_t local_window = 64;  // local mass: the last local_window positions, the query's included
};

// Per-row, per-head statistics, in this order in CapturedRows::stats.
enum RowStat : int { kSinkMass = 0, kLocalMass = 1, kEntropy = 2, kNumRowStats = 3 };
// Names for files and JSON, indexed by RowStat.
inline constexpr const char* kRowStatNames[kNumRowStats] = {"sink_mass", "local_mass",
                                                            "entropy"};

struct CapturedRows {
  std::vector<int64_t> positions;  // [rows]
  std::vector<float> q;            // [rows][num_heads][head_dim], post-RoPE, as attention saw it
  std::vector<float> stats;        // [rows][num_heads][kNumRowStats]; entropy in nats
  std::vector<float> k, v;         // [rows][num_kv_heads][head_dim], the rows' own K (post-RoPE), V
};

class CapturingAttention : public model::SequenceAttention {
 public:
  // Wraps `inner`. `prefix`, when given, holds the keys of the tokens `inner` already stores (a
  // copied prefill); it is read here and not kept. Without it `inner` must start empty.
  CapturingAttention(std::unique_ptr<model::SequenceAttention> inner,
                     const model::AttentionShape& shape, const CaptureOptions& options,
                     const model::DenseAttention* prefix = nullptr);

  // Calls the wrapped attention, then records rows at positions >= capture_from. Errors of the
  // wrapped attention are returned as they are (nothing is recorded); FailedPrecondition when the
  // tokens do not continue the keys this decorator holds (a missing `prefix`).
  absl::Status Forward(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                       const float* v, float* out) override;

  const CapturedRows& rows(int layer) const { return rows_[layer]; }
  model::SequenceAttention& inner() { return *inner_; }
  const model::SequenceAttention& inner() const { return *inner_; }

 private:
  std::unique_ptr<model::SequenceAttention> inner_;
  model::AttentionShape shape_;
  CaptureOptions options_;
  std::vector<std::vector<float>> keys_;  // [layer] -> [length][num_kv_heads][head_dim]
  std::vector<CapturedRows> rows_;        // [layer]
};

// Statistics of one query row against keys [0, position]: writes kNumRowStats floats per head to
// `stats` ([num_heads][kNumRowStats]). Exposed for tests.
void ComputeRowStats(const model::AttentionShape& shape, const CaptureOptions& options,
                     const float* q_row, const float* keys, int64_t position, float* stats);

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_CAPTURING_ATTENTION_H_
