// `fluxion eval compare A.json B.json`: two `fluxion eval tasks --json` runs over the same seeds
// (e.g. --device cpu and --device cuda), sample by sample. A is the reference. Every sample of a
// (task, context, seed, policy) present in both runs is
//   identical   the same generated tokens;
//   near-tie    the tokens first differ at a step where A's greedy choice was a near-tie: A's
//               top-2 logit margin there is at most near_tie_relative x max(1, |A's top logit|)
//               (the numeric noise between the paths can flip such a choice; after the first
//               differing token the two continuations feed different tokens and are not
//               comparable any more);
//   divergence  the tokens first differ where A's choice was clear: the paths compute different
//               things, not the same thing with different rounding.
// Default near_tie_relative 0.04: twice the 2e-2 whole-step logit tolerance of the CUDA dense
// halves against the CPU (model/cuda_dense_ops_test.cc: a flip is excused when the margin is
// within twice the row's largest logit difference).
//
// The threshold is an assumption about how far the two paths' logits may differ; the comparison
// also measures it: per policy, over every decode step the paired samples share (both runs fed the
// same tokens so far), the largest difference of the top logit and of the margin, relative to
// max(1, |A's top logit|). A measured noise near or above the threshold means the threshold is too
// tight for these paths (e.g. `full` on the cpu device attends fp32 K/V, through the hybrid
// executor bf16 pages) or that they compute different things; a reviewer reads both.
#ifndef FLUXION_BENCH_EVAL_EVAL_COMPARE_H_
#define FLUXION_BENCH_EVAL_EVAL_COMPARE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace fluxion::eval {

struct SampleKey {
  std::string task;
  int64_t context = 0;
  uint64_t seed = 0;
  std::string policy;
  bool operator==(const SampleKey& o) const {
    return task == o.task && context == o.context && seed == o.seed && policy == o.policy;
  }
};

// One sample's decode as `fluxion eval tasks --json` records it under "samples".
struct SampleRecord {
  SampleKey key;
  std::vector<int32_t> tokens;
  bool correct = false;
  std::vector<float> margins;     // per token: top-2 logit margin of the step that chose it
  std::vector<float> top_logits;  // per token: the largest logit of that step
};

struct EvalRun {
  std::string device;  // "cpu" when the file predates --device
  std::vector<SampleRecord> samples;
};

// The samples of a parsed eval JSON. InvalidArgument naming `name` and the sample for a document
// without per-sample records, a field of the wrong type, margins or top logits whose count is not
// the token count, or a sample listed twice.
absl::StatusOr<EvalRun> ParseEvalRun(const nlohmann::json& doc, const std::string& name);

// One side made of several runs (e.g. one file per context or task group, to keep each run short):
// their samples in order. InvalidArgument when the runs' devices differ or a sample is in two.
absl::StatusOr<EvalRun> MergeEvalRuns(const std::vector<EvalRun>& parts);

enum class Verdict { kIdentical, kNearTie, kDivergence };
const char* VerdictName(Verdict v);

struct SampleComparison {
  SampleKey key;
  Verdict verdict = Verdict::kIdentical;
  bool correct_a = false, correct_b = false;
  // For differing samples: the first generated step (0 = the prefill's token) whose token differs
  // and each run's token there (-1 where that run had already stopped), A's margin and top logit
  // there and the near-tie threshold they were judged by, B's margin there (NaN if none).
  int64_t first_diff_step = -1;
  int32_t token_a = -1, token_b = -1;
  float margin_a = 0, top_logit_a = 0, threshold = 0, margin_b = 0;
};

// How far two runs' logits differ where they were fed the same tokens (see above).
struct PolicyNoise {
  std::string policy;
  int64_t steps = 0;     // shared decode steps measured (the prefill's token excluded)
  double top_logit = 0;  // max |top_a - top_b| / max(1, |top_a|)
  double margin = 0;     // max |margin_a - margin_b| / max(1, |top_a|)
};

// Per policy over the paired samples: A's and B's accuracy and their paired difference
// (B - A) with a 95% interval (paired_stats.h).
struct PolicyAccuracy {
  std::string policy;
  int64_t n = 0, correct_a = 0, correct_b = 0;
  int64_t lost = 0, gained = 0;  // correct in A only, in B only
  double delta = 0, delta_low = 0, delta_high = 0;
};

struct EvalComparison {
  std::string device_a, device_b;
  double near_tie_relative = 0;
  std::vector<SampleComparison> samples;  // every sample in both runs, in A's order
  int64_t identical = 0, near_ties = 0, divergences = 0;
  int64_t correct_flips = 0;  // samples scored differently (a subset of the differing ones)
  std::vector<SampleKey> only_a, only_b;
  std::vector<PolicyNoise> noise;  // per policy, in A's order of first appearance
  std::vector<PolicyAccuracy> accuracy;  // per policy, in A's order of first appearance
};

struct CompareOptions {
  double near_tie_relative = 0.04;
};

// For `--guard-pairs`: A keeps its samples of policies without the error guard, B those with it
// (`fluxion@0.02+guard`), renamed to the policy without the suffix, so each policy pairs with
// itself under the guard.
void SplitGuardPairs(EvalRun* a, EvalRun* b);

EvalComparison CompareEvalRuns(const EvalRun& a, const EvalRun& b, const CompareOptions& options);

// The comparison as the --json output writes it (every count, and each differing sample).
nlohmann::json ComparisonJson(const EvalComparison& c);

// `fluxion eval compare A.json B.json [--json OUT] [--near-tie R]` (args exclude "compare"); each
// side may be a comma-separated list of files (MergeEvalRuns). Exit 0 when no sample diverges, 1
// when one does (or a file cannot be read), 2 for usage.
int RunEvalCompareCommand(const std::vector<std::string>& args);

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_EVAL_COMPARE_H_
