// Attention-level quality of a sparse selection against full attention, shared by the synthetic
// and the captured-data evaluations (`fluxion eval attention`).
#ifndef FLUXION_BENCH_ATTENTION_QUALITY_H_
#define FLUXION_BENCH_ATTENTION_QUALITY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "decode/kv/paged_kv.h"
#include "decode/sparse/policy.h"
#include "kernels/paged_attention.h"
#include "nlohmann/json.hpp"

namespace fluxion::bench {

// Sums over decode steps (and heads); printed and written as means.
struct Metrics {
  double rel_err = 0, recall = 0, overlap = 0, read = 0;
  double guard_read = 0;  // rows the error guard's exact checks read / context (besides `read`)
  int64_t n = 0, overlap_n = 0;  // overlap only counts steps where the policy chose middle rows

  void Add(const Metrics& o);
  nlohmann::json ToJson() const;
  // One table row under PrintQualityHeader.
  void Print(const std::string& first, int64_t context, const std::string& label) const;
};

void PrintQualityHeader(const std::string& first_column);

// Recall and top-k overlap of one policy's selection for one (layer, KV head) at one step:
// recall = share of full attention's mass (from the stored bf16 keys, averaged over the group)
// on the selected rows; overlap = share of the exact top-k middle rows (same count as the policy
// chose between sinks and window) that it selected. Adds one step to `m` (not rel_err).
//   q: [group][head_dim]; full_lse: [group], natural-base LSE of full attention's scaled scores.
void AddSelectionQuality(const decode::PagedKv& kv, int layer, int kv_head, const float* q,
                         int64_t group, float scale, int64_t ctx,
                         const std::vector<kernels::PageSpan>& spans,
                         const decode::sparse::PolicyConfig& config, const float* full_lse,
                         int64_t rows_attended, Metrics* m);

// |got - want| / |want| (L2).
double RelativeError(const std::vector<double>& got, const std::vector<double>& want);

// y[rows] = w[rows][cols] . x[cols], in double.
std::vector<double> Project(const std::vector<float>& w, int64_t rows, int64_t cols,
                            const std::vector<float>& x);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_ATTENTION_QUALITY_H_
