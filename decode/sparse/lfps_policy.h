// LFPS ("Learn from the Past", docs/ALGORITHMS.md §1.3-1.5) as a SparsePolicy.
//
// Per (layer, KV head) it keeps vertical/slash history tables (lfps_tables.h), initialised from
// the prefill's last query rows and updated after every step with the half-normalised weights of
// the rows the step attended. A step:
//   1. folds keys that left the local window into running key mean/covariance (and value mean);
//   2. estimates the head's sparsity rho = Z(sinks + window) / Z(all), the global part from a
//      log-normal model of q.k over the folded keys; rho >= epsilon (0.95; the paper's 0.85 for
//      `lfps_paper`) for every query head of the group, and the middle's measured share at most
//      1 - epsilon -> bypass: attend sinks + window only (`lfps`), or additionally merge the global
//      region's mean value vector with the estimated mass (`lfps_paper`, as published);
//   3. otherwise: kurtosis-adaptive thresholds on both tables give candidate positions, expanded
//      by {-1, 0, +1, +2}, scored exactly, top rows within the budget; every `refresh_every`
//      steps an exact top-k over the whole middle region instead (the safety valve).
//
// Step-ahead table picks (PrepareNextStep): the tables' candidates depend on the history alone,
// not on the query, so once a step is observed the next step's table picks (both clamps, the
// expansion, the bitmap) can be made right away, off the next step's critical path (the hybrid
// step does it while the next layer selects: decode/step/hybrid_batch_attention.h). Select uses
// them only when the step's regions and budget are the ones they were made for, else makes its own:
// the picks are the same either way.
//
// Thread-compatible (one request), with one exception a shared object relies on (Fluxion:
// PolicyTraits::heads_independent false): once every (layer, KV head) is prepared, Select and
// Observe (and PrepareNextStep) for different KV heads may run concurrently, and so may those of
// one KV head in two adjacent layers (the hybrid step observes layer l while it selects layer
// l + 1): per-head state lives per (layer, KV head), scratch per (layer parity, KV head); the
// maps are only read after Prepare.
#ifndef FLUXION_DECODE_SPARSE_LFPS_POLICY_H_
#define FLUXION_DECODE_SPARSE_LFPS_POLICY_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "decode/sparse/decision_profile.h"
#include "decode/sparse/device_selection.h"
#include "decode/sparse/lfps_tables.h"
#include "decode/sparse/policy.h"
#include "decode/sparse/policy_util.h"

namespace fluxion::decode::sparse {

struct LfpsParams {
  double decay = 0.95;           // r [SEED]
  double threshold_a = 0.2;      // a in theta = mu + a sqrt(kurtosis) sigma [SEED value]
  double candidate_cap = 0.1;    // |V| + |D| <= cap * context [ENG]
  int64_t refresh_every = 32;    // exact top-k refresh period [ENG]
  // epsilon: bypass when sinks + window hold >= this share of the mass (estimated) and the middle
  // held <= 1 - epsilon when last measured. The paper's 0.85 [SEED] (kept by `lfps_paper`)
  // bypasses heads whose small middle share still carries the answer on our model. Chosen on the
  // calibration seeds (500,000+, never evaluated on; 4K, passage/aggregate/niah_multivalue, n = 8
  // each, budgets 0.02/0.05): samples lost against full 7/6 at 0.85, 3/2 at 0.90 and at 0.95;
  // 0.95 is the more conservative of the two. [ENG]
  double bypass_rho = 0.95;
  double min_weight = 1e-4;      // smaller table additions are dropped: keeps tables sparse
  int64_t rescale_every = 256;   // lazy-decay rescale period [ENG]
};

// The published bypass threshold (`lfps_paper`).
inline constexpr double kPaperBypassRho = 0.85;

class LfpsPolicy : public SparsePolicy {
 public:
  LfpsPolicy(const PolicyConfig& config, const LfpsParams& params, bool paper_bypass);

  absl::Status Prepare(const PagedKv& kv, int layer, int kv_head,
                       const model::HeadSparseState* state) override;
  void Select(const SelectionInput& in, std::vector<kernels::PageSpan>* spans,
              SelectionStats* stats) override;
  void Observe(const SelectionInput& in, const std::vector<kernels::PageSpan>& spans) override;
  void PrepareNextStep(const SelectionInput& next) override;
  bool ApproximateRest(const SelectionInput& in, float* out, float* lse) override;
  double MiddleWeight(int layer, int kv_head) override;
  // Under Selector::kDevice: the table candidates (made a step ahead, as the host path's) or, on
  // a refresh step, the whole middle, for the compact-key top-k. Nothing (k 0) for a head-step a
  // decision profile bypasses.
  std::optional<DeviceAsk> DevicePick(const SelectionInput& in) override;

 protected:
  static constexpr int kShareMemory = 8;
  struct HeadState {
    explicit HeadState(const LfpsParams& p) : tables(p.decay, p.rescale_every) {}
    LfpsTables tables;
    // Keys in [sink_end, folded_end) are folded into the global-region statistics.
    int64_t folded_end = 0;
    int64_t count = 0;
    std::vector<double> key_sum, key_outer, value_sum;  // [d], [d][d], [d]
    int64_t steps_since_refresh = 0;
    bool bypassed = false;
    // Exact share of attention mass on the middle region (between sinks and window): the peak
    // over the last kShareMemory steps that looked at it (the prefill tail counts as one). The
    // log-normal estimate cannot see rare high-logit keys (needles) among the folded ones, so a
    // head whose middle recently held mass is never bypassed on the estimate alone. A peak, not
    // the last value: a copy head's target moves every step and its share swings with each
    // target key (4% to 30% on the synthetic copy head), so a single low step is no evidence
    // (with the last value, LFPS bypassed that head after one 4% step and lost 13% of its mass
    // for the next refresh period; docs/SPARSE.md). Unknown before the first measurement
    // (1: no bypass).
    double MiddleShare() const;
    void NoteMiddleShare(double share);
    std::array<double, kShareMemory> recent_shares{};  // a ring; the first recent_count are set
    int recent_count = 0, recent_next = 0;
    int64_t steps_since_measured = 0;
    // From the prefill tail: the fraction of middle tokens holding 90% of the middle mass
    // (1 when unknown). Fluxion sizes per-head budgets from it.
    double need_fraction = 1.0;
    std::vector<double> global_log_mass;  // [group], log of the estimated global partition
    // Under a decision profile: this head's drawn class, block and weight (drawn at first use).
    bool replay_drawn = false;
    HeadReplay replay;
    // The next step's table picks made ahead (PrepareNextStep), as a CandidateMarks bitmap over
    // the middle [sink_end, local_begin) at `context` tokens for a middle budget of k rows;
    // context < 0: none.
    struct PreparedPicks {
      int64_t context = -1, k = 0, sink_end = 0, local_begin = 0;
      std::vector<uint64_t> bits;
    } prepared;
  };

  // Scratch of one KV head's step (heads of a shared object may run in parallel), reused
  // across steps and layers.
  struct Scratch {
    std::vector<kernels::PageSpan> spans;
    std::vector<kernels::PageSpan> middle;  // the picked middle rows' spans
    std::vector<float> scores;
    std::vector<int32_t> picked, picked_local;
    std::vector<int32_t> candidates;        // this step's expanded candidates, sorted
    std::vector<int64_t> vertical, slash;   // the tables' picks (positions / distances)
    std::vector<float> fold_keys;           // FoldGlobal's keys widened to fp32
    std::vector<uint64_t> candidate_bits;   // CandidateMarks' bitmap over the middle
    std::vector<uint64_t> picked_bits;      // the rescoring's picks over [0, candidates)
    std::vector<double> kq;                 // [head_dim]: summed key outer products times q
    std::vector<float> page_scores, block_scores;  // Fluxion's query-aware scan
    std::vector<int32_t> top_blocks;
    std::vector<float> group_scores;  // [candidate][group] unscaled
    // This step's scaled logits [row][group] of the sinks then the window (edge_logits; the
    // first sink_rows rows are the sinks) and of the picked middle rows in position order
    // (picked_logits), when Select computed all of them (logits_valid): Observe reuses them.
    std::vector<float> edge_logits, picked_logits;
    int64_t sink_rows = 0;
    bool logits_valid = false;
    // Observe: the attended positions, and per query head of the group its half-normalised
    // weights [group][row] and its middle share (each head a task: RunAsTasks).
    std::vector<int32_t> positions;
    std::vector<float> head_weights;
    std::vector<float> best_weights;  // [row]: the group's largest half-normalised weight
    std::vector<double> head_exps;  // [group][row]: exp(logit - the head's max over all rows)
    std::vector<double> head_middle_share;
    CompactSelection compact;  // LFPS and Fluxion under Selector::kDevice
  };

  // Both create the head's entry on first use. Heads of a shared object selected in parallel
  // must have been prepared (creating an entry is not safe concurrently). Scratch is per layer
  // parity: a layer's observation may run while the next layer selects.
  HeadState& State(int layer, int kv_head);
  Scratch& ScratchOf(int layer, int kv_head) {
    const size_t i = 2 * static_cast<size_t>(kv_head) + (layer & 1);
    if (i >= scratch_.size()) scratch_.resize(i + 2 - (layer & 1));
    return scratch_[i];
  }
  // Under a decision profile (replaying() true): what the profile decided for the head.
  bool replaying() const { return profile_ != nullptr; }
  const HeadReplay& Replay(int layer, int kv_head);
  // The block size a retrieval head-step of (layer, kv_head) selects at, as decision profiles
  // record it: LFPS selects tokens (kTokenLevelBlock).
  virtual int64_t RetrievalBlock(int layer, int kv_head) { return kTokenLevelBlock; }
  // Rows of the middle region this step may attend for (layer, kv_head); LFPS: the policy
  // budget's share (SplitContext). Fluxion overrides it with per-head budgets.
  virtual int64_t MiddleBudget(int layer, int kv_head, const Regions& r, int64_t context);
  // The step's regions with the middle budget it may spend: MiddleBudget (or the profile's
  // weight), then the error guard's shift. A pure function of the input and the head's state.
  Regions StepRegions(const SelectionInput& in);
  // Whether a step at `context` of head state `s` refreshes exactly instead of using the tables.
  bool RefreshDue(const HeadState& s) const;
  // Marks the tables' picks for a step at `context` (t = context - 1) with middle budget k,
  // expanded, into `marks` (both clamps of ALGORITHMS.md §1.3.4-1.3.5).
  void MarkTablePicks(HeadState& s, Scratch& x, const Regions& r, int64_t context, int64_t k,
                      CandidateMarks* marks);
  // Marks rows of the middle region [r.sink_end, r.local_begin) as this step's candidates too
  // (runs; overlaps with the tables' picks are fine) before they are rescored for the top `k`.
  // LFPS: none (its candidates come from history alone). Fluxion marks its query-aware top
  // blocks.
  virtual void AddCandidates(const SelectionInput& in, const Regions& r, int64_t k,
                             CandidateMarks* marks, SelectionStats* stats) {}
  void FoldGlobal(const PagedKv& kv, int layer, int kv_head, int64_t sink_end, int64_t end,
                  HeadState* s);
  // Select's phases. MeasureStreaming: the head-sparsity estimate (ALGORITHMS.md §1.3.8) of the
  // step's query group, the sinks' and window's logits kept in x.edge_logits; true when every
  // query head of the group looks streaming. Bypasses: whether this head-step reads no middle
  // row (the guard's shift forbids it; a profile decides when replaying; else the estimate,
  // re-measured every refresh period). PickExactly: the refresh's exact top-k over the whole
  // middle. PickFromTables: the tables' candidates (prepared a step ahead or made now, plus
  // AddCandidates'), rescored for the top k. Both leave the picks in x.picked.
  bool MeasureStreaming(const SelectionInput& in, const Regions& r, HeadState& s, Scratch& x);
  bool Bypasses(const SelectionInput& in, const HeadState& s, bool all_streaming);
  void PickExactly(const SelectionInput& in, const Regions& r, HeadState& s, Scratch& x,
                   SelectionStats* stats);
  void PickFromTables(const SelectionInput& in, const Regions& r, HeadState& s, Scratch& x,
                      SelectionStats* stats);
  // Selector::kDevice's picks in place of both: the compact-key top-k of AskFor's rows, appended
  // to *middle as spans.
  void PickOnDevice(const SelectionInput& in, const Regions& r, HeadState& s, Scratch& x,
                    std::vector<kernels::PageSpan>* middle, SelectionStats* stats);
  // What the device picks from at the step of `in` (regions r): the whole middle when a refresh
  // is due, else the tables' candidates (PreparedCandidates).
  DeviceAsk AskFor(const SelectionInput& in, const Regions& r, HeadState& s);
  // The tables' expanded candidates of the step of `in` as a CandidateMarks bitmap over r's
  // middle, in s.prepared: made a step ahead (PrepareNextStep) when they were for these regions
  // and budget, else now (and kept there for the step's Select).
  const std::vector<uint64_t>& PreparedCandidates(const SelectionInput& in, const Regions& r,
                                                  HeadState& s);
  // Scaled logits of every query head of the group over `spans`' rows, in span order:
  // (*out)[row * group + g]. One walk over the keys for the whole group.
  static void GroupLogits(const PagedKv& kv, const std::vector<kernels::PageSpan>& spans,
                          const float* q, int64_t group, float scale, std::vector<float>* out);

  PolicyConfig config_;
  LfpsParams params_;
  bool paper_bypass_;
  std::map<std::pair<int, int>, HeadState> states_;
  std::shared_ptr<const DecisionProfile> profile_;  // null: decisions from the data
  PolicyDecisions replay_;                          // profile_'s entry for this policy

 private:
  std::vector<Scratch> scratch_;  // [kv_head * 2 + layer parity], sized by Prepare
};

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_LFPS_POLICY_H_
