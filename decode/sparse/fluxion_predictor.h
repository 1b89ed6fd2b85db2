// Fluxion's head-property predictor (docs/ALGORITHMS.md §2.4.3): from a head's prefill
// features, whether it is a streaming head (sinks + local window suffice: e_h(0) <= tau) and, for
// a retrieval head, its budget tier (the smallest of {0.02, 0.05} with e_h(b) <= tau).
//
// The model is two logistic regressions over standardised features, fitted offline by
// `fluxion calibrate --model DIR` (bench/eval/predictor_fit.h) from calibration runs of that
// model; its parameters travel as JSON (format in docs/CALIBRATE.md), normally
// <model>/fluxion_predictor.json.
//
// Thread-safe: immutable after Parse.
#ifndef FLUXION_DECODE_SPARSE_FLUXION_PREDICTOR_H_
#define FLUXION_DECODE_SPARSE_FLUXION_PREDICTOR_H_

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/sparse_state.h"

namespace fluxion::decode::sparse {

inline constexpr int kPredictorFormatVersion = 1;
inline constexpr int kNumPredictorFeatures = 6;
// The features in the order the file's weights use them (the file must list exactly these).
inline constexpr std::array<const char*, kNumPredictorFeatures> kPredictorFeatureNames = {
    "middle_share", "need_fraction", "sink_mass", "local_mass", "entropy", "layer_frac"};
// The file name `fluxion generate` / `fluxion eval tasks` look for next to the model.
inline constexpr const char* kPredictorFileName = "fluxion_predictor.json";

using PredictorFeatures = std::array<double, kNumPredictorFeatures>;

// A head's features in kPredictorFeatureNames order: the sparse state's five, then
// layer / num_layers.
PredictorFeatures HeadFeatures(const model::HeadSparseState& state, int layer, int num_layers);

struct HeadPrediction {
  bool streaming = false;
  double p_streaming = 0;  // the classifier's probability of a streaming head
  double tier = 0;         // retrieval heads: the predicted budget tier (0.02 or 0.05); 0 streaming
};

class FluxionPredictor {
 public:
  // Parses and validates the JSON text. InvalidArgument, with the field at fault, for anything
  // else than a version-1 file with exactly kPredictorFeatureNames, finite means, positive finite
  // scales, finite weights and biases, tiers in (0, 1].
  static absl::StatusOr<FluxionPredictor> Parse(absl::string_view json_text);
  // Reads and parses `path`. NotFound when it cannot be read; Parse's errors prefixed with the path.
  static absl::StatusOr<std::shared_ptr<const FluxionPredictor>> Load(const std::string& path);

  HeadPrediction Predict(const PredictorFeatures& features) const;

  double tau() const { return tau_; }

 private:
  FluxionPredictor() = default;
  PredictorFeatures mean_{}, scale_{}, streaming_w_{}, tier_w_{};
  double streaming_b_ = 0, tier_b_ = 0, threshold_ = 0.5, tau_ = 0.02;
  std::array<double, 2> tiers_{0.02, 0.05};  // tier classifier: 0 -> tiers_[0], 1 -> tiers_[1]
};

// The predictor a command should use: `flag` "none" -> none (the rule-based fallback); a path ->
// that file (errors as Load); empty -> `<model_dir>/fluxion_predictor.json` when that file exists,
// else none. Returns nullptr for none.
absl::StatusOr<std::shared_ptr<const FluxionPredictor>> ResolvePredictor(
    const std::string& flag, const std::string& model_dir);

// As ResolvePredictor, for a command that runs the `fluxion` policy (serving, eval, generate): a
// model without a predictor is a FailedPrecondition naming the fix, unless `flag` is "none".
// Never a silent fallback: the rule-based split lost 85.7 points at 4K / 0.02 on our model
// (docs/SPARSE.md, "Fluxion: the head-property predictor and the rule-based fallback"), and every
// published checkpoint comes without a predictor.
absl::StatusOr<std::shared_ptr<const FluxionPredictor>> RequirePredictor(
    const std::string& flag, const std::string& model_dir);

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_FLUXION_PREDICTOR_H_
