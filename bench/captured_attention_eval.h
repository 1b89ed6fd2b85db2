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
//
// With `head_table_csv` set, also writes Fluxion's predictor training table there
// (docs/CALIBRATE.md, "Head table"): one row per (sample, decode step, layer, KV head) with the
// head's prefill features (the sparse state's five, from the prompt's last 32 query rows, plus
// layer / num_layers) and its labels: e_h(b) for b in {0, 0.02, 0.05} (ALGORITHMS.md §2.4.2:
// error after the head's W_O slice relative to the layer's output, sink-free partial outputs,
// exact top-k of the middle region), the same after merging the sinks back, and the output
// contribution c_h (a label-side quantity: it needs the step's full output). `configs` may then
// be empty (table only). Internal when the file cannot be written.
absl::StatusOr<nlohmann::json> EvalCapturedAttention(
    const std::string& capture_dir, const std::string& model_dir,
    const std::vector<decode::sparse::PolicyConfig>& configs,
    const std::string& head_table_csv = "");

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_CAPTURED_ATTENTION_EVAL_H_
