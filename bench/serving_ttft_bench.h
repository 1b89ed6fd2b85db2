// `fluxion bench serving-ttft`: the TTFT split of a running prefill + decode pair.
#ifndef FLUXION_BENCH_SERVING_TTFT_BENCH_H_
#define FLUXION_BENCH_SERVING_TTFT_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// `args`: the flags after `fluxion bench serving-ttft`. Returns the process exit code.
int RunServingTtftBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_SERVING_TTFT_BENCH_H_
