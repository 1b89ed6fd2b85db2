#ifndef FLUXION_BENCH_CAPTURED_ATTENTION_EVAL_H_
#define FLUXION_BENCH_CAPTURED_ATTENTION_EVAL_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "decode/sparse/policy.h"
#include "nlohmann/json.hpp"

namespace fluxion::bench {

// Replays the decode steps captured by `fluxion eval tasks --capture-dir DIR` (policy `full`,
// prompts with K/V) through every policy config, on exactly the keys each step saw, and compares
// with full attention: error after the layer's real W_O (from `model_dir`, or the model the index
// names when empty), mass recall, top-k overlap, budget spent. Prints a table per task and policy
// and returns the result rows. NotFound / InvalidArgument for a missing or malformed capture.
absl::StatusOr<nlohmann::json> EvalCapturedAttention(
    const std::string& capture_dir, const std::string& model_dir,
    const std::vector<decode::sparse::PolicyConfig>& configs);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_CAPTURED_ATTENTION_EVAL_H_
