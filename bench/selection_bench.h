// `fluxion bench selection`: device selection's kernels (kernels/cuda/compact_select.h) at
// serving shapes on the lent GPU: the compact-key scan (CompactScores) against the HBM copy probe
// of the same run, the per-(request, KV head) top-k (CompactSelectBest), and the two together
// (CompactTopK, what the hybrid step issues per layer). Built only with CUDA.
#ifndef FLUXION_BENCH_SELECTION_BENCH_H_
#define FLUXION_BENCH_SELECTION_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

int RunSelectionBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_SELECTION_BENCH_H_
