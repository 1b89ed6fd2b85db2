// `fluxion bench decode`: the decode step of a batch of requests, measured one of two ways, picked
// by --device:
//   without --device      the CPU step executors: the batched executor against the per-request
//                         loop, same run, same host pages (bench/executor_bench.h);
//   --device cpu|cuda     the hybrid CPU-GPU step at real model shapes with random weights, with the
//                         GPU-only step of the same run (bench/hybrid_bench.h).
// One flag set and one --help for both; this file maps the flags to the chosen measurement's
// options, checks them and runs it.
#ifndef FLUXION_BENCH_DECODE_BENCH_H_
#define FLUXION_BENCH_DECODE_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

int RunDecodeBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_DECODE_BENCH_H_
