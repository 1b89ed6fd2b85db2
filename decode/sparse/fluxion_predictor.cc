#include "decode/sparse/fluxion_predictor.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace fluxion::decode::sparse {
namespace {

using nlohmann::json;

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("fluxion predictor: ", what,
                   " (refit it with `fluxion calibrate --model DIR`, or pass "
                   "--fluxion-predictor none for the rule-based fallback)"));
}

absl::StatusOr<double> FiniteNumber(const json& obj, const std::string& key,
                                    const std::string& where) {
  if (!obj.is_object() || !obj.contains(key) || !obj[key].is_number()) {
    return Bad(absl::StrCat(where, key, " must be a number"));
  }
  const double v = obj[key].get<double>();
  if (!std::isfinite(v)) return Bad(absl::StrCat(where, key, " is not finite"));
  return v;
}

absl::Status FiniteVector(const json& obj, const std::string& key, const std::string& where,
                          PredictorFeatures* out) {
  if (!obj.is_object() || !obj.contains(key) || !obj[key].is_array()) {
    return Bad(absl::StrCat(where, key, " must be an array of ", kNumPredictorFeatures,
                            " numbers"));
  }
  const json& a = obj[key];
  if (a.size() != kNumPredictorFeatures) {
    return Bad(absl::StrCat(where, key, " has ", a.size(), " values, the features are ",
                            kNumPredictorFeatures));
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].is_number() || !std::isfinite(a[i].get<double>())) {
      return Bad(absl::StrCat(where, key, "[", i, "] is not a finite number"));
    }
    (*out)[i] = a[i].get<double>();
  }
  return absl::OkStatus();
}

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace

PredictorFeatures HeadFeatures(const model::HeadSparseState& s, int layer, int num_layers) {
  return {s.middle_share, s.need_fraction, s.sink_mass, s.local_mass, s.entropy,
          num_layers > 0 ? static_cast<double>(layer) / num_layers : 0.0};
}

absl::StatusOr<FluxionPredictor> FluxionPredictor::Parse(absl::string_view text) {
  const json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return Bad("the file is not valid JSON, or not a JSON object");
  if (!doc.contains("version") || !doc["version"].is_number_integer()) {
    return Bad("no integer \"version\"");
  }
  if (doc["version"].get<int64_t>() != kPredictorFormatVersion) {
    return Bad(absl::StrCat("version ", doc["version"].get<int64_t>(), " is not supported (this ",
                            "build reads version ", kPredictorFormatVersion, ")"));
  }
  if (!doc.contains("features") || !doc["features"].is_array()) {
    return Bad("no \"features\" array");
  }
  std::vector<std::string> names;
  for (const json& n : doc["features"]) {
    if (!n.is_string()) return Bad("\"features\" holds a non-string");
    names.push_back(n.get<std::string>());
  }
  const std::vector<std::string> want(kPredictorFeatureNames.begin(),
                                      kPredictorFeatureNames.end());
  if (names != want) {
    return Bad(absl::StrCat("features [", absl::StrJoin(names, ", "), "] differ from the ",
                            kNumPredictorFeatures, " this build computes: [",
                            absl::StrJoin(want, ", "), "]"));
  }
  FluxionPredictor p;
  if (absl::Status s = FiniteVector(doc, "mean", "", &p.mean_); !s.ok()) return s;
  if (absl::Status s = FiniteVector(doc, "scale", "", &p.scale_); !s.ok()) return s;
  for (size_t i = 0; i < p.scale_.size(); ++i) {
    if (!(p.scale_[i] > 0)) return Bad(absl::StrCat("scale[", i, "] must be > 0"));
  }
  auto tau = FiniteNumber(doc, "tau", "");
  if (!tau.ok()) return tau.status();
  if (!(*tau > 0 && *tau < 1)) return Bad("tau must lie in (0, 1)");
  p.tau_ = *tau;
  if (!doc.contains("streaming") || !doc["streaming"].is_object()) {
    return Bad("no \"streaming\" classifier object");
  }
  const json& st = doc["streaming"];
  if (absl::Status s = FiniteVector(st, "weights", "streaming.", &p.streaming_w_); !s.ok()) {
    return s;
  }
  auto sb = FiniteNumber(st, "bias", "streaming.");
  if (!sb.ok()) return sb.status();
  p.streaming_b_ = *sb;
  if (st.contains("threshold")) {
    auto t = FiniteNumber(st, "threshold", "streaming.");
    if (!t.ok()) return t.status();
    if (!(*t > 0 && *t < 1)) return Bad("streaming.threshold must lie in (0, 1)");
    p.threshold_ = *t;
  }
  if (!doc.contains("tier") || !doc["tier"].is_object()) return Bad("no \"tier\" classifier object");
  const json& tr = doc["tier"];
  if (absl::Status s = FiniteVector(tr, "weights", "tier.", &p.tier_w_); !s.ok()) return s;
  auto tb = FiniteNumber(tr, "bias", "tier.");
  if (!tb.ok()) return tb.status();
  p.tier_b_ = *tb;
  if (!tr.contains("tiers") || !tr["tiers"].is_array() || tr["tiers"].size() != 2) {
    return Bad("tier.tiers must be an array of 2 budgets");
  }
  for (int i = 0; i < 2; ++i) {
    const json& t = tr["tiers"][i];
    if (!t.is_number() || !(t.get<double>() > 0 && t.get<double>() <= 1)) {
      return Bad(absl::StrCat("tier.tiers[", i, "] must be a budget in (0, 1]"));
    }
    p.tiers_[i] = t.get<double>();
  }
  return p;
}

absl::StatusOr<std::shared_ptr<const FluxionPredictor>> FluxionPredictor::Load(
    const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read fluxion predictor file ", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<FluxionPredictor> p = Parse(text.str());
  if (!p.ok()) {
    return absl::Status(p.status().code(), absl::StrCat(path, ": ", p.status().message()));
  }
  return std::make_shared<const FluxionPredictor>(std::move(*p));
}

HeadPrediction FluxionPredictor::Predict(const PredictorFeatures& f) const {
  double zs = streaming_b_, zt = tier_b_;
  for (int i = 0; i < kNumPredictorFeatures; ++i) {
    // Non-finite features (a degenerate capture) count as the mean: no evidence either way.
    const double z = std::isfinite(f[i]) ? (f[i] - mean_[i]) / scale_[i] : 0.0;
    zs += streaming_w_[i] * z;
    zt += tier_w_[i] * z;
  }
  HeadPrediction out;
  out.p_streaming = Sigmoid(zs);
  out.streaming = out.p_streaming > threshold_;
  out.tier = out.streaming ? 0.0 : tiers_[Sigmoid(zt) > 0.5 ? 1 : 0];
  return out;
}

absl::StatusOr<std::shared_ptr<const FluxionPredictor>> ResolvePredictor(
    const std::string& flag, const std::string& model_dir) {
  if (flag == "none") return std::shared_ptr<const FluxionPredictor>();
  if (!flag.empty()) return FluxionPredictor::Load(flag);
  const std::string beside = model_dir + "/" + kPredictorFileName;
  if (!std::ifstream(beside)) return std::shared_ptr<const FluxionPredictor>();
  return FluxionPredictor::Load(beside);
}

absl::StatusOr<std::shared_ptr<const FluxionPredictor>> RequirePredictor(
    const std::string& flag, const std::string& model_dir) {
  FLUXION_ASSIGN_OR_RETURN(std::shared_ptr<const FluxionPredictor> predictor,
                           ResolvePredictor(flag, model_dir));
  if (predictor != nullptr || flag == "none") return predictor;
  return absl::FailedPreconditionError(absl::StrCat(
      "the fluxion policy needs a head-property predictor for this model, and ", model_dir,
      " has no ", kPredictorFileName, ": run `fluxion calibrate --model ", model_dir,
      "` to fit one beside the weights (docs/CALIBRATE.md), or pass --fluxion-predictor FILE, "
      "or --fluxion-predictor none to run fluxion's rule-based per-head budgets knowingly (they "
      "lost 85.7 points at 4K / 0.02 on our model)"));
}

}  // namespace fluxion::decode::sparse
