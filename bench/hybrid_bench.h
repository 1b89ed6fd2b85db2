// `fluxion bench decode --device cpu|cuda`: the hybrid decode step (decode/hybrid_step_executor.h)
// at real model shapes with random weights made in the dense backend's memory and the KV in host
// pages: TPOT and tokens/s per (context, batch, policy), the per-step breakdown of the attention's
// CPU phases, and the GPU-only step (every plan resident: the dense work, the window and the
// step's fixed costs) in the same run, from which the GPU's idle share is estimated.
#ifndef FLUXION_BENCH_HYBRID_BENCH_H_
#define FLUXION_BENCH_HYBRID_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

int RunHybridBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_HYBRID_BENCH_H_
