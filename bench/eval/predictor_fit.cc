#include "bench/eval/predictor_fit.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace fluxion::eval {
namespace {

using decode::sparse::kNumPredictorFeatures;
using decode::sparse::kPredictorFeatureNames;

constexpr std::array<double, 2> kTiers = {0.02, 0.05};
// Regularisation strengths tried by cross-validation.
constexpr std::array<double, 7> kLambdas = {1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0};

double Sigmoid(double z) { return 1.0 / (1.0 + std::exp(-std::clamp(z, -30.0, 30.0))); }

// --- The head table ---

// Column positions of the fields the fit reads, from the header line.
struct Columns {
  int sample = -1, task = -1, context = -1, seed = -1, layer = -1, kv_head = -1;
  std::array<int, kNumPredictorFeatures> x{};
  std::array<int, 3> e{};
  int middle_rows_002 = -1;
};

absl::StatusOr<Columns> ReadColumns(const std::string& header, const std::string& path) {
  std::map<std::string, int> at;
  int i = 0;
  for (absl::string_view name : absl::StrSplit(header, ',')) at[std::string(name)] = i++;
  auto find = [&](const std::string& name, int* out) -> absl::Status {
    auto it = at.find(name);
    if (it == at.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": no column '", name, "' (write it with fluxion eval attention "
                       "--head-table)"));
    }
    *out = it->second;
    return absl::OkStatus();
  };
  Columns c;
  FLUXION_RETURN_IF_ERROR(find("sample", &c.sample));
  FLUXION_RETURN_IF_ERROR(find("task", &c.task));
  FLUXION_RETURN_IF_ERROR(find("context", &c.context));
  FLUXION_RETURN_IF_ERROR(find("seed", &c.seed));
  FLUXION_RETURN_IF_ERROR(find("layer", &c.layer));
  FLUXION_RETURN_IF_ERROR(find("kv_head", &c.kv_head));
  for (int f = 0; f < kNumPredictorFeatures; ++f) {
    FLUXION_RETURN_IF_ERROR(find(kPredictorFeatureNames[f], &c.x[f]));
  }
  FLUXION_RETURN_IF_ERROR(find("e_0", &c.e[0]));
  FLUXION_RETURN_IF_ERROR(find("e_002", &c.e[1]));
  FLUXION_RETURN_IF_ERROR(find("e_005", &c.e[2]));
  FLUXION_RETURN_IF_ERROR(find("middle_rows_002", &c.middle_rows_002));
  return c;
}

// A head being averaged over its steps.
struct HeadSum {
  CalibrationHead head;
  std::array<double, 3> e_sum{};
  int64_t steps = 0;
};

// Adds one CSV line's fields to its head; `where` names the line in errors.
absl::Status AddRow(const std::vector<absl::string_view>& f, const Columns& c,
                    const std::string& where,
                    std::map<std::tuple<std::string, int64_t, int64_t>, HeadSum>* heads,
                    std::vector<std::tuple<std::string, int64_t, int64_t>>* order) {
  auto number = [&](int col, double* out) -> absl::Status {
    if (col >= static_cast<int>(f.size()) || !absl::SimpleAtod(f[col], out)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": column ", col + 1,
                                                     " is not a number"));
    }
    return absl::OkStatus();
  };
  double layer = 0, kv_head = 0, context = 0, seed = 0, rows = 0;
  FLUXION_RETURN_IF_ERROR(number(c.layer, &layer));
  FLUXION_RETURN_IF_ERROR(number(c.kv_head, &kv_head));
  FLUXION_RETURN_IF_ERROR(number(c.context, &context));
  FLUXION_RETURN_IF_ERROR(number(c.seed, &seed));
  FLUXION_RETURN_IF_ERROR(number(c.middle_rows_002, &rows));
  if (c.sample >= static_cast<int>(f.size()) || c.task >= static_cast<int>(f.size())) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": too few columns"));
  }
  const auto key = std::make_tuple(std::string(f[c.sample]), static_cast<int64_t>(layer),
                                   static_cast<int64_t>(kv_head));
  auto [it, inserted] = heads->try_emplace(key);
  HeadSum& h = it->second;
  if (inserted) {
    order->push_back(key);
    h.head.sample = std::string(f[c.sample]);
    h.head.task = std::string(f[c.task]);
    h.head.context = static_cast<int64_t>(context);
    h.head.seed = static_cast<uint64_t>(seed);
    for (int i = 0; i < kNumPredictorFeatures; ++i) {
      FLUXION_RETURN_IF_ERROR(number(c.x[i], &h.head.x[i]));
    }
    h.head.middle_rows_002 = static_cast<int64_t>(rows);
  }
  for (int b = 0; b < 3; ++b) {
    double e = 0;
    FLUXION_RETURN_IF_ERROR(number(c.e[b], &e));
    h.e_sum[b] += e;
  }
  h.head.middle_rows_002 = std::min(h.head.middle_rows_002, static_cast<int64_t>(rows));
  ++h.steps;
  return absl::OkStatus();
}

// --- Fitting ---

using Matrix = std::vector<std::vector<double>>;

// Solves a x = b for a symmetric positive definite `a` (Cholesky; a is at most 7 x 7 here, which
// no linear-algebra dependency is worth).
std::vector<double> SolveSpd(Matrix a, std::vector<double> b) {
  const size_t n = b.size();
  for (size_t j = 0; j < n; ++j) {
    double d = a[j][j];
    for (size_t k = 0; k < j; ++k) d -= a[j][k] * a[j][k];
    a[j][j] = std::sqrt(std::max(d, 1e-300));
    for (size_t i = j + 1; i < n; ++i) {
      double s = a[i][j];
      for (size_t k = 0; k < j; ++k) s -= a[i][k] * a[j][k];
      a[i][j] = s / a[j][j];
    }
  }
  for (size_t i = 0; i < n; ++i) {  // L y = b
    for (size_t k = 0; k < i; ++k) b[i] -= a[i][k] * b[k];
    b[i] /= a[i][i];
  }
  for (size_t i = n; i-- > 0;) {  // L^T x = y
    for (size_t k = i + 1; k < n; ++k) b[i] -= a[k][i] * b[k];
    b[i] /= a[i][i];
  }
  return b;
}

double Predict(const LogisticModel& m, const std::vector<double>& z) {
  double s = m.bias;
  for (size_t i = 0; i < z.size(); ++i) s += m.weights[i] * z[i];
  return Sigmoid(s);
}

// Per-feature mean and standard deviation (+1e-6, so a constant feature standardises to 0).
struct Standardiser {
  std::vector<double> mean, scale;

  static Standardiser Of(const Matrix& x) {
    const size_t d = x.empty() ? 0 : x[0].size();
    Standardiser s{std::vector<double>(d, 0.0), std::vector<double>(d, 0.0)};
    for (const auto& row : x) {
      for (size_t i = 0; i < d; ++i) s.mean[i] += row[i] / x.size();
    }
    for (const auto& row : x) {
      for (size_t i = 0; i < d; ++i) s.scale[i] += (row[i] - s.mean[i]) * (row[i] - s.mean[i]);
    }
    for (double& v : s.scale) v = std::sqrt(v / std::max<size_t>(x.size(), 1)) + 1e-6;
    return s;
  }
  std::vector<double> Apply(const std::vector<double>& row) const {
    std::vector<double> z(row.size());
    for (size_t i = 0; i < row.size(); ++i) z[i] = (row[i] - mean[i]) / scale[i];
    return z;
  }
  Matrix Apply(const Matrix& x) const {
    Matrix z;
    for (const auto& row : x) z.push_back(Apply(row));
    return z;
  }
};

// Fold of every sample: the distinct samples in name order, shuffled by our own Fisher-Yates over
// std::mt19937_64 (fully specified, unlike std::shuffle), dealt round-robin.
std::vector<int> FoldsOf(const std::vector<std::string>& samples, int k) {
  const std::set<std::string> names(samples.begin(), samples.end());
  std::vector<std::string> distinct(names.begin(), names.end());
  std::mt19937_64 rng(0);
  for (size_t i = distinct.size(); i > 1; --i) std::swap(distinct[i - 1], distinct[rng() % i]);
  std::map<std::string, int> fold;
  for (size_t i = 0; i < distinct.size(); ++i) fold[distinct[i]] = static_cast<int>(i % k);
  std::vector<int> out;
  for (const std::string& s : samples) out.push_back(fold[s]);
  return out;
}

struct Labelled {
  Matrix x;
  std::vector<double> y;
  std::vector<int> fold;
};

Labelled Subset(const Labelled& all, const std::vector<bool>& keep) {
  Labelled out;
  for (size_t i = 0; i < keep.size(); ++i) {
    if (!keep[i]) continue;
    out.x.push_back(all.x[i]);
    out.y.push_back(all.y[i]);
    out.fold.push_back(all.fold[i]);
  }
  return out;
}

struct CrossValidation {
  double lambda = 1.0;
  double log_loss = 0;
  std::vector<double> p;  // out-of-fold probabilities at `lambda`
};

// Out-of-fold probabilities for every lambda; the one of the smallest log loss.
CrossValidation CrossValidate(const Labelled& data, int k) {
  CrossValidation best;
  bool have = false;
  for (double lambda : kLambdas) {
    std::vector<double> p(data.y.size(), 0.0);
    for (int f = 0; f < k; ++f) {
      std::vector<bool> train(data.y.size()), valid(data.y.size());
      for (size_t i = 0; i < data.y.size(); ++i) {
        train[i] = data.fold[i] != f;
        valid[i] = data.fold[i] == f;
      }
      const Labelled tr = Subset(data, train);
      if (tr.y.size() == data.y.size()) continue;  // an empty fold
      double positives = 0;
      for (double y : tr.y) positives += y;
      const bool one_class = positives == 0 || positives == static_cast<double>(tr.y.size());
      const Standardiser s = Standardiser::Of(tr.x);
      LogisticModel m;
      if (!one_class) m = FitLogistic(s.Apply(tr.x), tr.y, lambda);
      for (size_t i = 0; i < data.y.size(); ++i) {
        if (!valid[i]) continue;
        p[i] = one_class ? positives / std::max<size_t>(tr.y.size(), 1)
                         : Predict(m, s.Apply(data.x[i]));
      }
    }
    double loss = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      loss -= data.y[i] * std::log(p[i] + 1e-9) + (1 - data.y[i]) * std::log(1 - p[i] + 1e-9);
    }
    loss /= std::max<size_t>(p.size(), 1);
    if (!have || loss < best.log_loss) best = {lambda, loss, std::move(p)};
    have = true;
  }
  return best;
}

nlohmann::json Metrics(const std::vector<double>& y, const std::vector<double>& p,
                       double threshold) {
  int64_t tp = 0, tn = 0, fp = 0, fn = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const bool pred = p[i] > threshold, pos = y[i] == 1.0;
    tp += pred && pos;
    tn += !pred && !pos;
    fp += pred && !pos;
    fn += !pred && pos;
  }
  const double n = static_cast<double>(y.size());
  const double share = n > 0 ? (tp + fn) / n : 0.0;
  return {{"n", y.size()},
          {"accuracy", n > 0 ? (tp + tn) / n : 0.0},
          {"balanced_accuracy",
           0.5 * (tp / static_cast<double>(std::max<int64_t>(tp + fn, 1)) +
                  tn / static_cast<double>(std::max<int64_t>(tn + fp, 1)))},
          {"majority_baseline", n > 0 ? std::max(share, 1 - share) : 0.0},
          {"positives", tp + fn},
          {"true_pos", tp},
          {"true_neg", tn},
          {"false_pos", fp},
          {"false_neg", fn}};
}

nlohmann::json ModelJson(const LogisticModel& m) {
  return {{"weights", m.weights}, {"bias", m.bias}};
}

}  // namespace

absl::StatusOr<std::vector<CalibrationHead>> ReadHeadTable(const std::string& csv_path) {
  std::ifstream in(csv_path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", csv_path));
  std::string line;
  if (!std::getline(in, line)) {
    return absl::InvalidArgumentError(absl::StrCat(csv_path, " is empty"));
  }
  FLUXION_ASSIGN_OR_RETURN(Columns columns, ReadColumns(line, csv_path));
  std::map<std::tuple<std::string, int64_t, int64_t>, HeadSum> heads;
  std::vector<std::tuple<std::string, int64_t, int64_t>> order;
  for (int64_t line_no = 2; std::getline(in, line); ++line_no) {
    if (line.empty()) continue;
    const std::vector<absl::string_view> fields = absl::StrSplit(line, ',');
    FLUXION_RETURN_IF_ERROR(AddRow(fields, columns, absl::StrCat(csv_path, ":", line_no), &heads,
                                   &order));
  }
  std::vector<CalibrationHead> out;
  for (const auto& key : order) {
    HeadSum& h = heads[key];
    for (int b = 0; b < 3; ++b) h.head.e[b] = h.e_sum[b] / h.steps;
    out.push_back(std::move(h.head));
  }
  return out;
}

LogisticModel FitLogistic(const Matrix& z, const std::vector<double>& y, double lambda) {
  const size_t n = z.size(), d = n > 0 ? z[0].size() : 0;
  std::vector<double> w(d + 1, 0.0);  // the bias last
  for (int iter = 0; iter < 50; ++iter) {
    std::vector<double> grad(d + 1, 0.0);
    Matrix hess(d + 1, std::vector<double>(d + 1, 0.0));
    for (size_t r = 0; r < n; ++r) {
      double s = w[d];
      for (size_t i = 0; i < d; ++i) s += w[i] * z[r][i];
      const double p = Sigmoid(s), g = (p - y[r]) / n, h = p * (1 - p) / n;
      for (size_t i = 0; i <= d; ++i) {
        const double zi = i < d ? z[r][i] : 1.0;
        grad[i] += g * zi;
        for (size_t j = 0; j <= i; ++j) hess[i][j] += h * zi * (j < d ? z[r][j] : 1.0);
      }
    }
    for (size_t i = 0; i <= d; ++i) {
      const double reg = i < d ? lambda : 0.0;
      grad[i] += reg * w[i];
      hess[i][i] += reg + 1e-9;
      for (size_t j = 0; j < i; ++j) hess[j][i] = hess[i][j];
    }
    const std::vector<double> step = SolveSpd(hess, grad);
    double largest = 0;
    for (size_t i = 0; i <= d; ++i) {
      w[i] -= step[i];
      largest = std::max(largest, std::abs(step[i]));
    }
    if (largest < 1e-10) break;
  }
  return {std::vector<double>(w.begin(), w.begin() + d), w[d]};
}

absl::StatusOr<nlohmann::json> FitPredictor(const std::vector<CalibrationHead>& all_heads,
                                            const FitOptions& o) {
  std::vector<CalibrationHead> heads;
  for (const CalibrationHead& h : all_heads) {
    if (std::all_of(h.x.begin(), h.x.end(), [](double v) { return std::isfinite(v); })) {
      heads.push_back(h);
    }
  }
  if (heads.empty()) return absl::InvalidArgumentError("no head with finite features to fit");
  Labelled stream;
  std::vector<std::string> samples;
  for (const CalibrationHead& h : heads) {
    stream.x.emplace_back(h.x.begin(), h.x.end());
    stream.y.push_back(h.e[0] <= o.tau ? 1.0 : 0.0);
    samples.push_back(h.sample);
  }
  stream.fold = FoldsOf(samples, o.folds);
  const double streaming_share =
      std::count(stream.y.begin(), stream.y.end(), 1.0) / static_cast<double>(stream.y.size());
  if (streaming_share == 0.0 || streaming_share == 1.0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "every calibration head is ", streaming_share == 1.0 ? "streaming" : "a retrieval head",
        " at tau ", o.tau, ": nothing to tell apart (calibrate over longer or more prompts)"));
  }
  const CrossValidation cv_stream = CrossValidate(stream, o.folds);
  std::vector<double> rules;
  for (const CalibrationHead& h : heads) rules.push_back(h.x[0] < 1 - o.rules_rho ? 1.0 : 0.0);

  // The tier's rows: retrieval heads whose context leaves the 0.02 tier middle rows.
  std::vector<bool> tier_rows(heads.size());
  Labelled tier_all = stream;
  for (size_t i = 0; i < heads.size(); ++i) {
    tier_rows[i] = stream.y[i] == 0.0 && heads[i].middle_rows_002 > 0;
    tier_all.y[i] = heads[i].e[1] > o.tau ? 1.0 : 0.0;
  }
  const Labelled tier = Subset(tier_all, tier_rows);
  const double tier_positives = std::count(tier.y.begin(), tier.y.end(), 1.0);
  const bool tier_two_class = tier_positives > 0 && tier_positives < tier.y.size();

  const Standardiser s = Standardiser::Of(stream.x);
  const LogisticModel streaming = FitLogistic(s.Apply(stream.x), stream.y, cv_stream.lambda);
  LogisticModel tier_model{std::vector<double>(kNumPredictorFeatures, 0.0), 0.0};
  nlohmann::json tier_validation = {{"n", tier.y.size()}};
  if (tier_two_class && static_cast<int>(tier.y.size()) >= 2 * o.folds) {
    const CrossValidation cv_tier = CrossValidate(tier, o.folds);
    tier_validation = Metrics(tier.y, cv_tier.p, 0.5);
    tier_validation["lambda"] = cv_tier.lambda;
    tier_validation["log_loss"] = cv_tier.log_loss;
    tier_model = FitLogistic(s.Apply(tier.x), tier.y, cv_tier.lambda);
  } else {
    // One class (or too few rows to validate): a constant classifier at the majority, 0.05
    // when there is no row at all (the safe tier).
    const double frac = tier.y.empty() ? 1.0 : tier_positives / tier.y.size();
    tier_model.bias = frac >= 0.5 ? 5.0 : -5.0;
    tier_validation["note"] = "too few or one-class rows: a constant tier";
  }

  nlohmann::json stream_validation = Metrics(stream.y, cv_stream.p, o.threshold);
  stream_validation["threshold"] = o.threshold;
  stream_validation["lambda"] = cv_stream.lambda;
  stream_validation["log_loss"] = cv_stream.log_loss;
  stream_validation["rules_fallback"] = Metrics(stream.y, rules, 0.5);
  std::map<int64_t, std::vector<size_t>> by_context;
  std::set<std::string> tasks;
  std::set<uint64_t> seeds;
  for (size_t i = 0; i < heads.size(); ++i) {
    by_context[heads[i].context].push_back(i);
    tasks.insert(heads[i].task);
    seeds.insert(heads[i].seed);
  }
  nlohmann::json per_context = nlohmann::json::object();
  for (const auto& [context, rows] : by_context) {
    std::vector<double> y, p, r;
    std::array<double, 3> mean_e{};
    for (size_t i : rows) {
      y.push_back(stream.y[i]);
      p.push_back(cv_stream.p[i]);
      r.push_back(rules[i]);
      for (int b = 0; b < 3; ++b) mean_e[b] += heads[i].e[b] / rows.size();
    }
    per_context[std::to_string(context)] = {
        {"heads", rows.size()},
        {"streaming_share", std::count(y.begin(), y.end(), 1.0) / static_cast<double>(y.size())},
        {"streaming_accuracy", Metrics(y, p, o.threshold)["accuracy"]},
        {"rules_accuracy", Metrics(y, r, 0.5)["accuracy"]},
        {"mean_e", mean_e}};
  }
  nlohmann::json streaming_json = ModelJson(streaming);
  streaming_json["threshold"] = o.threshold;
  streaming_json["label"] = "mean over decode steps of e_h(0) <= tau";
  nlohmann::json tier_json = ModelJson(tier_model);
  tier_json["tiers"] = kTiers;
  tier_json["label"] = "retrieval heads: 1 (tier 0.05) when mean e_h(0.02) > tau";
  return nlohmann::json{
      {"format", "fluxion-head-predictor"},
      {"version", decode::sparse::kPredictorFormatVersion},
      {"features", kPredictorFeatureNames},
      {"mean", s.mean},
      {"scale", s.scale},
      {"tau", o.tau},
      {"streaming", streaming_json},
      {"tier", tier_json},
      {"calibration",
       {{"seeds", seeds.empty() ? std::vector<uint64_t>{}
                                : std::vector<uint64_t>{*seeds.begin(), *seeds.rbegin()}},
        {"samples", std::set<std::string>(samples.begin(), samples.end()).size()},
        {"tasks", tasks},
        {"contexts", [&] {
           std::vector<int64_t> c;
           for (const auto& [context, rows] : by_context) c.push_back(context);
           return c;
         }()},
        {"heads", heads.size()},
        {"tier_heads", tier.y.size()}}},
      {"validation",
       {{"method", absl::StrCat(o.folds, "-fold cross-validation over samples (held-out prompts)")},
        {"streaming", stream_validation},
        {"tier", tier_validation},
        {"per_context", per_context}}},
      {"command", o.command},
  };
}

}  // namespace fluxion::eval
