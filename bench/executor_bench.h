// The CPU executors' half of `fluxion bench decode` (the command is bench/decode_bench.h): the
// decode step of a batch of requests through the step executors (decode/step/step_executor.h), the
// batched CPU executor (every weight read once per step) against the per-request loop (one
// Model::Forward per request, the decode node before the batched seam), measured in the same run
// over the same host pages, per model, context, policy, thread count and batch size.
#ifndef FLUXION_BENCH_EXECUTOR_BENCH_H_
#define FLUXION_BENCH_EXECUTOR_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "decode/sparse/error_guard.h"
#include "nlohmann/json.hpp"

namespace fluxion::bench {

struct ExecutorBenchOptions {
  std::string model_dir;  // empty: random weights of `preset`
  std::string preset = "qwen2.5-0.5b";
  std::string kv = "auto";  // prompt KV: auto, prefill or random
  std::vector<int64_t> contexts = {1024, 4096, 16384};
  std::vector<int64_t> batches = {1, 4, 8, 16};
  std::vector<int64_t> threads = {1};  // one pool per value
  std::vector<std::string> policies = {"full", "fluxion"};
  std::vector<double> budgets = {0.05};
  int64_t steps = 3;
  std::vector<bool> guard_modes = {false};  // --guard: each guardable policy per mode
  decode::sparse::GuardConfig guard;
};

// Prints one table row per (context, policy, threads, batch) as it is measured and appends the
// same row to `results` (a JSON array). REQUIRES: `o` validated (bench/decode_bench.cc).
absl::Status RunExecutorBench(const ExecutorBenchOptions& o, nlohmann::json* results);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_EXECUTOR_BENCH_H_
