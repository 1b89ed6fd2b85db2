// The long-context evaluation tasks of docs/TASKS.md (v1), generated in C++ for `fluxion eval
// tasks`. The training side (tools/train/tasks.py) implements the same text formats and
// distributions independently with its own random streams; what must match is the text, so the
// formats here follow TASKS.md to the byte and tasks_test.cc checks them.
//
// Determinism: a sample is a pure function of (task, context, seed), identical on every platform
// (std::mt19937_64 and std::seed_seq are fully specified; the uniform draws are our own because
// std::uniform_int_distribution differs between standard libraries).
//
// Thread-safe: pure functions.
#ifndef FLUXION_BENCH_EVAL_TASKS_H_
#define FLUXION_BENCH_EVAL_TASKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fluxion::eval {

// Training uses seeds below this; evaluation and calibration use this and above, so no evaluation
// prompt is ever a training prompt. MakeTaskSample enforces it.
inline constexpr uint64_t kFirstEvalSeed = 1000000;

// Calibration seeds (docs/TASKS.md): [kFirstCalibrationSeed, kFirstCalibrationSeed +
// kCalibrationSeeds), below every evaluation seed and far above the training steps' seeds (the
// Python generators used step indices < 20,000). Offline predictors (tools/fluxion_predictor) are
// fitted on these only, so no evaluation prompt is ever a calibration prompt.
inline constexpr uint64_t kFirstCalibrationSeed = 500000;
inline constexpr uint64_t kCalibrationSeeds = 1000;

// True for a seed of the calibration range.
inline bool IsCalibrationSeed(uint64_t seed) {
  return seed >= kFirstCalibrationSeed && seed < kFirstCalibrationSeed + kCalibrationSeeds;
}

struct TaskSample {
  std::string task;
  int64_t context = 0;  // the requested context length L
  uint64_t seed = 0;
  // BOS followed by the bytes of prompt_text; its size lies in [0.9 L, L].
  std::vector<int32_t> prompt_ids;
  // haystack + "\n\n" + question + " " + answer prefix. Ends with a space (the answer prefix's).
  std::string prompt_text;
  // The prompt's tail after the blank line: question + " " + answer prefix.
  std::string query;
  // What the model must generate before its "\n" for the sample to count as correct.
  std::string answer;
};

// niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, aggregate, passage.
const std::vector<std::string>& TaskNames();

// One evaluation prompt of `task` whose token count lies in [0.9 context_tokens, context_tokens].
// InvalidArgument: an unknown task (the message lists the valid names), a seed below
// kFirstEvalSeed outside the calibration range, or a context too short to hold the task's items and question.
absl::StatusOr<TaskSample> MakeTaskSample(const std::string& task, int64_t context_tokens,
                                          uint64_t seed);

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_TASKS_H_
