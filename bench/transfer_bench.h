// `fluxion bench transfer`: KV-shaped pages written through UCX into a forked process (GB/s).
#ifndef FLUXION_BENCH_TRANSFER_BENCH_H_
#define FLUXION_BENCH_TRANSFER_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

// `args`: the flags after `fluxion bench transfer`. Returns the process exit code.
int RunTransferBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_TRANSFER_BENCH_H_
