#ifndef FLUXION_BENCH_ATTENTION_BENCH_H_
#define FLUXION_BENCH_ATTENTION_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// `fluxion bench attention` (flags after "attention"); returns the exit code.
int RunAttentionBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_ATTENTION_BENCH_H_
