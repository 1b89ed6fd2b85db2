// Fluxion (../shared/docs/ALGORITHMS.md §2.4) as a SparsePolicy, first version: output-aware
// per-head budgets on top of LFPS's history-based candidates.
//
// At prefill each (layer, KV head) gets two features from the prompt's last query rows: its
// middle share (attention mass outside sinks and window) and its need (the fraction of middle
// tokens holding 90% of that mass). Heads whose middle share is below 1 - epsilon are streaming
// heads and get no middle budget; the rest share the request's total middle budget in proportion
// to share x need, so the request as a whole reads exactly what a uniform policy at the same
// budget reads. Selection within a head's budget is LFPS's (tables -> candidates -> exact
// rescoring, periodic refresh, bypass).
//
// Not yet (issue 5): features measured after W_O (output contribution), the trained predictor and
// its rule-based fallback split, granularity/budget choice from {16, 32, 64} x {0.02, 0.05} by the
// calibrated cost model, and LFPS candidates shrinking Quest block scoring.
#ifndef FLUXION_DECODE_SPARSE_FLUXION_POLICY_H_
#define FLUXION_DECODE_SPARSE_FLUXION_POLICY_H_

#include <map>
#include <utility>

#include "decode/sparse/lfps_policy.h"

namespace fluxion::decode::sparse {

class FluxionPolicy : public LfpsPolicy {
 public:
  explicit FluxionPolicy(const PolicyConfig& config);

 protected:
  int64_t MiddleBudget(int layer, int kv_head, const Regions& r, int64_t context) override;

 private:
  // Per-head weights share x need, normalised to sum to the number of heads (0 for streaming).
  void Allocate();
  std::map<std::pair<int, int>, double> weight_;
  bool allocated_ = false;
};

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_FLUXION_POLICY_H_
