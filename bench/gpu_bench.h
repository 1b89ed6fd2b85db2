// `fluxion bench gpu`: the GPU kernels of the decode step at Llama-3.1-8B shapes on the lent
// device, against the machine's measured limits: bf16 GEMMs (weight-read bound at decode batch
// sizes) vs the HBM copy probe, paged decode attention over HBM-resident KV vs the same probe, and
// attention reading selected pages straight from pinned host memory (zero-copy) vs the pinned
// host-to-device copy probe. Built only with CUDA.
#ifndef FLUXION_BENCH_GPU_BENCH_H_
#define FLUXION_BENCH_GPU_BENCH_H_

#include <string>
#include <vector>

namespace fluxion::bench {

int RunGpuBench(const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_GPU_BENCH_H_
