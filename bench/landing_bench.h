// `fluxion bench landing`: LandPrompt's verify-and-adopt time at Llama-3.1-8B KV shapes.
#ifndef FLUXION_BENCH_LANDING_BENCH_H_
#define FLUXION_BENCH_LANDING_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// `args`: the flags after `fluxion bench landing`. Returns the process exit code.
int RunLandingBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_LANDING_BENCH_H_
