#ifndef FLUXION_BENCH_MODEL_BENCH_H_
#define FLUXION_BENCH_MODEL_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// `fluxion bench model` (flags after "model"); returns the exit code.
int RunModelBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_MODEL_BENCH_H_
