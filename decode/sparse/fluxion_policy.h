// Fluxion (../shared/docs/ALGORITHMS.md §2.4) as a SparsePolicy: output-aware per-head budgets
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
// the middle (the predictor's case; the rules then keep the uniform budget, as v1 did). Selection
// within a head's budget is LFPS's (tables -> candidates -> exact rescoring, periodic refresh,
// bypass).
//
// Not yet (issue 5): granularity/budget choice from {16, 32, 64} x {0.02, 0.05} by the calibrated
// cost model, and LFPS candidates shrinking Quest block scoring.
//
// Thread-compatible (one request).
#ifndef FLUXION_DECODE_SPARSE_FLUXION_POLICY_H_
#define FLUXION_DECODE_SPARSE_FLUXION_POLICY_H_

#include <map>
#include <memory>
#include <utility>

#include "decode/sparse/fluxion_predictor.h"
#include "decode/sparse/lfps_policy.h"

namespace fluxion::decode::sparse {

class FluxionPolicy : public LfpsPolicy {
 public:
  // `predictor` null: the rule-based fallback.
  FluxionPolicy(const PolicyConfig& config, std::shared_ptr<const FluxionPredictor> predictor);

  absl::Status Prepare(const PagedKv& kv, int layer, int kv_head,
                       const model::HeadSparseState* state) override;

  // The weight of (layer, kv_head) after allocation (1 = the uniform share); for tests and
  // reports. Allocates on first use.
  double HeadWeight(int layer, int kv_head);

 protected:
  int64_t MiddleBudget(int layer, int kv_head, const Regions& r, int64_t context) override;

 private:
  void Allocate();
  std::shared_ptr<const FluxionPredictor> predictor_;
  // Features of the heads prepared with a sparse state (the predictor needs num_layers, known
  // only once every head is prepared).
  std::map<std::pair<int, int>, model::HeadSparseState> features_;
  std::map<std::pair<int, int>, double> weight_;
  bool allocated_ = false;
};

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_FLUXION_POLICY_H_
