// Fits Fluxion's head-property predictor (docs/ALGORITHMS.md §2.4.3; the decode side's reader is
// decode/sparse/fluxion_predictor.h) from the head table `fluxion eval attention --head-table`
// writes: the last stage of `fluxion calibrate` (docs/CALIBRATE.md).
//
// Rows are grouped per (sample, layer, KV head): the features are the prefill's (the same at
// every step) and each label is the mean e_h(b) over the sample's decode steps. Two
// L2-regularised logistic regressions on standardised features, fitted by Newton's method:
//   streaming: mean e_h(0) <= tau (sinks + local window suffice);
//   tier:      for retrieval heads, 1 (tier 0.05) when mean e_h(0.02) > tau; fitted only on heads
//              whose context leaves the 0.02 tier middle rows (below ~3.5K tokens it reads sinks
//              + window only, and the label says nothing).
// Validation is k-fold over samples (every head of a prompt in one fold, so no prompt is both
// fitted and validated on); the regularisation strength is chosen by the same folds' log loss.
//
// Thread-compatible: pure functions.
#ifndef FLUXION_BENCH_EVAL_PREDICTOR_FIT_H_
#define FLUXION_BENCH_EVAL_PREDICTOR_FIT_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "decode/sparse/fluxion_predictor.h"
#include "nlohmann/json.hpp"

namespace fluxion::eval {

// One (sample, layer, KV head) of a head table, its decode steps averaged.
struct CalibrationHead {
  std::string sample, task;
  int64_t context = 0;
  uint64_t seed = 0;
  decode::sparse::PredictorFeatures x{};
  std::array<double, 3> e{};     // mean e_h(b) for b = 0, 0.02, 0.05
  int64_t middle_rows_002 = 0;   // the fewest middle rows the 0.02 tier left over the steps
};

// The heads of a head-table CSV. InvalidArgument naming the line for a missing column or a
// field that is not a number; NotFound when the file cannot be read.
absl::StatusOr<std::vector<CalibrationHead>> ReadHeadTable(const std::string& csv_path);

struct FitOptions {
  double tau = 0.02;        // a head's error tolerance e_h(b) <= tau
  int folds = 5;            // cross-validation folds over samples
  double threshold = 0.5;   // P(streaming) above which a head is streaming
  // The rule-based fallback's streaming rule (middle_share < 1 - rho) at the serving default,
  // reported beside the predictor's accuracy for comparison.
  double rules_rho = 0.95;
  std::string command;      // recorded in the file, for people
};

// The predictor file (version 1, decode/sparse/fluxion_predictor.h) with its calibration and
// validation sections. InvalidArgument when no head has finite features or the streaming labels
// are one class only (nothing to fit: the message says which).
absl::StatusOr<nlohmann::json> FitPredictor(const std::vector<CalibrationHead>& heads,
                                            const FitOptions& options);

// --- Exposed for tests ---

struct LogisticModel {
  std::vector<double> weights;
  double bias = 0;
};

// The minimiser of mean log loss + lambda/2 |w|^2 (bias not penalised) over standardised rows
// `z` and labels `y` in {0, 1}, by Newton's method.
LogisticModel FitLogistic(const std::vector<std::vector<double>>& z, const std::vector<double>& y,
                          double lambda);

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_PREDICTOR_FIT_H_
