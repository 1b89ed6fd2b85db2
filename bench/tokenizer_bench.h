#ifndef FLUXION_BENCH_TOKENIZER_BENCH_H_
#define FLUXION_BENCH_TOKENIZER_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// `fluxion bench tokenizer` (flags after "tokenizer"); returns the exit code.
int RunTokenizerBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_TOKENIZER_BENCH_H_
