#ifndef FLUXION_BENCH_ATTENTION_EVAL_H_
#define FLUXION_BENCH_ATTENTION_EVAL_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// `fluxion eval attention` (flags after "attention"); returns the exit code.
int RunAttentionEval(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_ATTENTION_EVAL_H_
