// The built-in SequenceAttention: fp32 K/V for every layer in one growable cache, causal full
// attention through kernels/cpu. This is the model's own path (prefill, `fluxion generate`) and
// the oracle the paged and sparse implementations in decode/ are compared with.
//
// Thread-compatible (one sequence, one driver thread).
#ifndef FLUXION_MODEL_DENSE_ATTENTION_H_
#define FLUXION_MODEL_DENSE_ATTENTION_H_

#include <vector>

#include "model/attention.h"

namespace fluxion::model {

class DenseAttention : public SequenceAttention {
 public:
  // `max_tokens` bounds the cache (ResourceExhausted beyond it); 0 means unbounded.
  explicit DenseAttention(const AttentionShape& shape, int64_t max_tokens = 0);

  absl::Status Forward(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                       const float* v, float* out) override;

  // Records the query rows of positions in [first, end) (e.g. the prompt's last 32 rows, from
  // which sparse policies initialise their state, ALGORITHMS.md §1.3.3). Copies keep the setting.
  void RecordQueries(int64_t first, int64_t end) {
    record_from_ = first;
    record_end_ = end;
  }
  // Recorded rows of `layer`: [rows][num_heads][head_dim], post-RoPE, positions
  // recorded_positions(layer).
  const std::vector<float>& recorded_queries(int layer) const { return queries_[layer]; }
  const std::vector<int64_t>& recorded_positions(int layer) const { return positions_[layer]; }

  int64_t length(int layer) const { return lengths_[layer]; }
  // K/V rows of `layer`: [length][num_kv_heads][head_dim].
  const float* keys(int layer) const { return k_[layer].data(); }
  const float* values(int layer) const { return v_[layer].data(); }

 private:
  AttentionShape shape_;
  int64_t max_tokens_;
  std::vector<std::vector<float>> k_, v_;  // [layer] -> [length][num_kv_heads][head_dim]
  std::vector<int64_t> lengths_;
  int64_t record_from_ = 0, record_end_ = 0;  // empty range: record nothing
  std::vector<std::vector<float>> queries_;     // [layer] -> [rows][num_heads][head_dim]
  std::vector<std::vector<int64_t>> positions_;  // [layer] -> [rows]
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_DENSE_ATTENTION_H_
