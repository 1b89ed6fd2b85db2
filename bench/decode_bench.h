// `fluxion bench decode`: the decode step of a batch of requests through the step executors
// (decode/step_executor.h): the batched CPU executor (every weight read once per step) against
// the per-request loop (one Model::Forward per request, the decode node before the batched seam),
// measured in the same run over the same host pages, per model, context, policy, thread count
// and batch size.
#ifndef FLUXION_BENCH_DECODE_BENCH_H_
#define FLUXION_BENCH_DECODE_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

int RunDecodeBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_DECODE_BENCH_H_
