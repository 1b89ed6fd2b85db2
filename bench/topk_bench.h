#ifndef FLUXION_BENCH_TOPK_BENCH_H_
#define FLUXION_BENCH_TOPK_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// `fluxion bench topk` (flags after "topk"); returns the exit code.
int RunTopKBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_TOPK_BENCH_H_
