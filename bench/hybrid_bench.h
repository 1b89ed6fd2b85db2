// The hybrid half of `fluxion bench decode` (`--device cpu|cuda`; the command is
// bench/decode_bench.h): the hybrid decode step (decode/step/hybrid_step_executor.h) at real model
// shapes with random weights made in the dense backend's memory and the KV in host pages: TPOT and
// tokens/s per (context, batch, policy), the per-step breakdown of the attention's CPU phases, and
// the GPU-only step (every plan resident: the dense work, the window and the step's fixed costs) in
// the same run, from which the GPU's idle share is estimated.
#ifndef FLUXION_BENCH_HYBRID_BENCH_H_
#define FLUXION_BENCH_HYBRID_BENCH_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "decode/sparse/error_guard.h"
#include "kernels/cpu/cpu_pool.h"
#include "nlohmann/json.hpp"

namespace fluxion::bench {

struct HybridBenchOptions {
  std::string preset = "llama3.1-8b";
  std::string device = "cuda";  // cuda, or cpu (the host stand-in of the device half)
  std::vector<int64_t> contexts = {32768, 65536, 131072}, batches = {1, 4, 8, 16};
  std::vector<std::string> policies = {"full", "fixed_32_0.05", "fixed_32_0.02", "fixed_16_0.05"};
  std::vector<double> budgets = {0.05};
  // Decision profiles lfps and fluxion are timed under (each under every one): `conservative`
  // or a profile file (decode/sparse/decision_profile.h).
  std::vector<std::string> profiles = {"conservative"};
  int64_t steps = 5;
  // Where quest's / fixed_*'s block scores come from: the window's page bounds on the device,
  // or the CPU's scan of the host bounds; each value a row.
  std::vector<std::string> block_scores = {"device"};
  // Where exact_topk, lfps and fluxion choose their rows (decode/sparse/policy.h, Selector): host
  // and/or device (compact keys in HBM); each value a row.
  std::vector<std::string> selectors = {"device"};
  // Shares of the host rows the GPU reads itself from pinned host pages; each value a row.
  std::vector<double> device_read_shares = {0};
  // 1: one hybrid pipeline; 2: the ping-pong executor over two
  // (decode/step/ping_pong_step_executor.h); each value a row.
  std::vector<int64_t> micro_batches = {1};
  double host_memory_gib = 0;  // 0: 80% of MemAvailable
  // The preset's first `layers` layers only (0: all). A truncated model's step is not the
  // model's; this exists to profile the CPU half at real head shapes on a machine that cannot hold
  // the whole model (the per-layer work is the same at every layer).
  int64_t layers = 0;
  bool degrade_on_stall = false;  // every row with the stall guard (fluxion decode's flag)
  std::vector<bool> guard_modes = {false};  // --guard: each guardable policy per mode
  // The paged kernels the HBM-resident reference runs with (kernels/cuda/paged_decode.h); each a
  // row.
  std::vector<std::string> hbm_kernels = {"v5"};
  decode::sparse::GuardConfig guard;
};

// Prints the table row by row and appends each row to `results` (a JSON array); `flush` is called
// after every (context, batch) point, so a run cut short by a time limit keeps what it measured.
// `pool` is the process's one CPU pool (kernels/cpu/process_cpu.h), and must outlive the call.
// REQUIRES: `o` validated (bench/decode_bench.cc).
absl::Status RunHybridBench(const HybridBenchOptions& o, const kernels::cpu::CpuPool& pool,
                            nlohmann::json* results, const std::function<void()>& flush);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_HYBRID_BENCH_H_
