// Fluxion (docs/ALGORITHMS.md §2.4) as a SparsePolicy: output-aware per-head budgets
// on top of LFPS's history-based candidates.
//
// At prefill each (layer, KV head) has features from the prompt's last query rows (the sparse
// state: middle share, need fraction, sink and local mass, entropy). Before the first decode step
// the policy splits the request's total middle budget (what a uniform policy at the same budget
// reads, so every policy is compared at equal reads) over the heads by a per-head weight:
//   - with a trained predictor (fluxion_predictor.h, policy `fluxion` with one configured):
//     streaming heads weigh 0, retrieval heads their predicted budget tier (0.02 or 0.05);
//   - without one (the rule-based fallback, and always for `fluxion_rules`): heads whose middle
//     share is below 1 - epsilon are streaming (weight 0), the rest weigh middle_share x need.
// Weights are normalised to sum to the number of heads; if every head is streaming, no head reads
// the middle (the predictor's case; the rules then keep the uniform budget, as v1 did).
//
// Selection within a head's budget k: LFPS's history candidates (tables -> expansion) plus the rows
// of the query-aware top blocks (blocks holding 2k rows, at least 16), rescored exactly; the top k
// rows are attended. The block size per head comes from the granularity selector (granularity.h:
// host cost model + prefill coverage). A block's score is the largest Quest bound of its pages
// (sum_d max(q_d min_d, q_d max_d) over a page's keys, max over the group): an upper bound on q.k
// over the block at least as tight as the bound of the block's merged min/max, and one score per
// page whatever the block size, so the hybrid step's device, which scores every page next to the
// window (SelectionInput::block_scores), serves every head; without those scores the CPU scores
// the pages (PolicyTraits::ranks_page_bounds). ALGORITHMS.md §2.4.5
// proposes the reverse (score only LFPS's candidate blocks); on our model LFPS's candidates held
// 0.2-0.95 of the top-k mass per head (docs/SPARSE.md), so restricting the scan to them would cap
// quality at LFPS's, and the coarse bound scan costs 3-12% of the K/V bytes. The bypass is LFPS's
// at epsilon = 0.95.
//
// Under Selector::kDevice (docs/SPARSE.md, "Device selection") a head's k rows are the k best of
// its whole middle by compact-key score, picked on the hybrid step's GPU: the budgets above stay,
// the history tables, the query-aware block scan and the bypass are not used (they exist to keep
// a CPU's scan small; a scan of compact keys in HBM costs ~1 ms per 128K step and recalls more
// of the exact top-k than the candidates did).
//
// One object serves every KV head of a request (the allocation spans them); once every head is
// prepared, Select and Observe for different KV heads may run concurrently (the allocation runs
// once, on the first head that needs it), so a step's selection spreads over the pool per head.
#ifndef FLUXION_DECODE_SPARSE_FLUXION_POLICY_H_
#define FLUXION_DECODE_SPARSE_FLUXION_POLICY_H_

#include <map>
#include <memory>
#include <utility>

#include "absl/base/call_once.h"
#include "decode/sparse/fluxion_predictor.h"
#include "decode/sparse/granularity.h"
#include "decode/sparse/lfps_policy.h"

namespace fluxion::decode::sparse {

class FluxionPolicy : public LfpsPolicy {
 public:
  // `predictor` null: the rule-based fallback.
  FluxionPolicy(const PolicyConfig& config, std::shared_ptr<const FluxionPredictor> predictor);

  absl::Status Prepare(const PagedKv& kv, int layer, int kv_head,
                       const model::HeadSparseState* state) override;
  void Select(const SelectionInput& in, std::vector<kernels::PageSpan>* spans,
              SelectionStats* stats) override;
  void Observe(const SelectionInput& in, const std::vector<kernels::PageSpan>& spans) override;
  void PrepareNextStep(const SelectionInput& next) override;
  std::optional<DeviceAsk> DevicePick(const SelectionInput& in) override;

  // The weight of (layer, kv_head) after allocation (1 = the uniform share); for tests and
  // reports. Allocates on first use.
  double HeadWeight(int layer, int kv_head);
  // The guard's starting weight (policy.h): HeadWeight, or the profile's under one.
  double MiddleWeight(int layer, int kv_head) override;
  // The block size the head's query-aware scan uses (16, 32 or 64), 0 before its first scan.
  int64_t HeadBlock(int layer, int kv_head);

  // Candidate rows from the query-aware scan per attended row, and how much coverage a coarser
  // block may give up against 16-token blocks (granularity.h). [ENG]
  static constexpr int64_t kScanOver = 2;
  // At short contexts 2k rows are one or two blocks, fewer than the places a multi-value question
  // spreads over: the scan keeps at least 16 blocks (4K, 0.02, n = 16: niah_multivalue 1 -> 0
  // and aggregate 3 -> 2 samples lost against full; small samples, the direction is what
  // counts). At 128K 2k rows are ~320 blocks of 16, so this only matters below ~16K. [ENG]
  static constexpr int64_t kScanMinBlocks = 16;
  static constexpr double kCoverageTolerance = 0.02;

 protected:
  int64_t MiddleBudget(int layer, int kv_head, const Regions& r, int64_t context) override;
  void AddCandidates(const SelectionInput& in, const Regions& r, int64_t k,
                     CandidateMarks* marks, SelectionStats* stats) override;
  int64_t RetrievalBlock(int layer, int kv_head) override;

 private:
  void Allocate();
  // The page scores of the middle's pages [first_page, end_page) of in's head: in.block_scores
  // when they are page scores, else computed here from the page bounds. Returns them.
  const float* PageScores(const SelectionInput& in, int64_t first_page, int64_t end_page,
                          SelectionStats* stats);
  std::shared_ptr<const FluxionPredictor> predictor_;
  // Features of the heads prepared with a sparse state (the predictor needs num_layers, known
  // only once every head is prepared).
  std::map<std::pair<int, int>, model::HeadSparseState> features_;
  std::map<std::pair<int, int>, double> weight_;  // written once, by Allocate
  absl::once_flag allocated_;

  // The query-aware scan of one head: its granularity (0 before its first scan).
  struct HeadScan {
    std::vector<std::vector<double>> block_mass;  // per kFluxionBlocks entry; empty: no capture
    int64_t chosen_at_context = 0;
    int64_t block = 0;
    std::vector<double> coverage(int64_t k) const;  // per kFluxionBlocks entry
  };
  // Creates the entry of a head that was not prepared (not safe with heads in parallel).
  HeadScan& Scan(int layer, int kv_head);
  const HeadScan* FindScan(int layer, int kv_head) const;
  std::map<std::pair<int, int>, HeadScan> scans_;
};

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_FLUXION_POLICY_H_
