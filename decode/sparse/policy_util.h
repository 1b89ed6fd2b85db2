// Internal helpers shared by the policies in decode/sparse (not part of the policy interface).
#ifndef FLUXION_DECODE_SPARSE_POLICY_UTIL_H_
#define FLUXION_DECODE_SPARSE_POLICY_UTIL_H_

#include <cstdint>
#include <vector>

#include "decode/sparse/policy.h"

namespace fluxion::decode::sparse {

// The middle region [sink_end, local_begin) a sparse policy chooses from, and how many of its
// rows the budget leaves after sinks and the local window.
struct Regions {
  int64_t sink_end = 0, local_begin = 0, middle_rows_budget = 0;
};
Regions SplitContext(const PolicyConfig& c, int64_t context);
// SplitContext at the step's context, with the middle budget scaled by in.budget_scale (the
// hybrid step's stall guard, decode/step/stall_guard.h; 1 unless it degrades the step).
Regions SplitStep(const PolicyConfig& c, const SelectionInput& in);

// Sinks + the chosen middle spans + the local window, in token order; counts rows in *stats.
void AssembleSpans(const SelectionInput& in, const Regions& r,
                   const std::vector<kernels::PageSpan>& middle,
                   std::vector<kernels::PageSpan>* spans, SelectionStats* stats);

// Appends spans for sorted, distinct token positions, one span per run of consecutive tokens
// within a page.
void AppendPositions(const PagedKv& kv, int layer, int kv_head,
                     const std::vector<int32_t>& sorted_positions,
                     std::vector<kernels::PageSpan>* spans);
void AppendPositions(const PagedKv& kv, int layer, int kv_head, const int32_t* sorted_positions,
                     int64_t count, std::vector<kernels::PageSpan>* spans);

// Every query head's unscaled logits of the K rows at sorted, distinct `positions` of (layer,
// kv_head), group_scores[i * group + g] = q_g . k_i, and their max over the group, row_max[i]:
// in tasks of kernels::cpu::kScoreRowsPerTask positions (RunAsTasks), each building its own
// spans. Equal bit for bit to GroupScores over AppendPositions' spans. Rescoring LFPS's tens of
// thousands of candidates this way leaves no span building and no max over the group on the
// head-step's serial path (both ran there before, a fifth of an LFPS head-step beside the
// rescoring itself, measured on the H200 host).
void ScorePositionsInTasks(const PagedKv& kv, int layer, int kv_head,
                           const std::vector<int32_t>& positions, const float* q, int64_t group,
                           float* group_scores, float* row_max);

// A set of positions in [begin, end) as a bitmap (one bit per token, in *words, which it clears
// and reuses): runs are marked with word ORs and read out sorted and distinct, O(marks + range /
// 64). LFPS marks its expanded table picks here directly: they are many times its budget (2k
// table entries x 4 offsets, both tables), and sorting them was a fifth of its step at 5% of 8K
// (perf); pushing them to a vector first was the largest serial part of a head-step on the H200
// host (bench/results/perf-lfps-8b-128k-h200-20261204.txt).
class CandidateMarks {
 public:
  CandidateMarks(int64_t begin, int64_t end, std::vector<uint64_t>* words);
  // Over *words as marked before for the same [begin, end) (not cleared). REQUIRES: *words has
  // that range's size.
  static CandidateMarks Marked(int64_t begin, int64_t end, std::vector<uint64_t>* words);
  // Marks [first, first + count) clipped to [begin, end).
  void MarkRun(int64_t first, int64_t count);
  // Replaces *out with the marked positions, ascending.
  void ReadOut(std::vector<int32_t>* out) const;

 private:
  CandidateMarks(int64_t begin, int64_t end, std::vector<uint64_t>* words, bool clear);
  int64_t begin_, end_;
  std::vector<uint64_t>* words_;
};

// Keeps about `target` of the sorted positions (ceil(target / group) groups): they are cut into
// groups of `group` consecutive entries and evenly spaced whole groups are kept, so the kept
// spread over the range as the originals did and keep their runs (LFPS's candidates come in runs
// of its 4 expansion offsets; singletons would cost the rescoring a span per row, more than the
// model's candidates cost). Nothing is dropped when there are no more than `target`.
// Decision-profile replay of a recorded candidate volume (LFPS).
void ThinEvenly(int64_t target, int64_t group, std::vector<int32_t>* sorted_positions);

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_POLICY_UTIL_H_
