// `fluxion calibrate --model DIR`: fits the head-property predictor the `fluxion` policy needs for
// a checkpoint (docs/CALIBRATE.md) and writes it beside the weights as fluxion_predictor.json.
//
// Three stages in one process: the calibration prompts (docs/TASKS.md's tasks at calibration
// seeds, through the model's own tokenizer) run with full attention on the CPU engine while their
// queries, keys and values are captured to a work folder (task_eval.h); every captured decode step
// is replayed into the head table of per-head features and exact-top-k errors
// (captured_attention_eval.h); the predictor is fitted and cross-validated on it
// (predictor_fit.h).
#ifndef FLUXION_BENCH_EVAL_CALIBRATE_COMMAND_H_
#define FLUXION_BENCH_EVAL_CALIBRATE_COMMAND_H_

#include <string>
#include <vector>

namespace fluxion::eval {

// `args` excludes "calibrate". Returns the exit code: 0 written, 1 a failure while running
// (model, capture, fit, files), 2 a usage error.
int RunCalibrateCommand(const std::vector<std::string>& args);

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_CALIBRATE_COMMAND_H_
