#include "bench/eval/eval_compare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench/bench_util.h"
#include "bench/eval/paired_stats.h"
#include "common/flag_set.h"

namespace fluxion::eval {
namespace {

using ::nlohmann::json;

std::string KeyText(const SampleKey& k) {
  return absl::StrCat(k.task, " ", k.context, " seed ", k.seed, " ", k.policy);
}

struct KeyHash {
  size_t operator()(const SampleKey& k) const {
    return absl::HashOf(k.task, k.context, k.seed, k.policy);
  }
};

// `field` of `entry` as an array of numbers, each checked (the file is input, not trusted).
template <typename T>
absl::Status NumberArray(const json& entry, const char* field, const std::string& where,
                         std::vector<T>* out) {
  auto it = entry.find(field);
  if (it == entry.end() || !it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": \"", field, "\" must be an array"));
  }
  out->clear();
  out->reserve(it->size());
  for (const json& v : *it) {
    if (std::is_integral_v<T> ? !v.is_number_integer() : !v.is_number()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"", field, "\" holds a non-",
                                                     std::is_integral_v<T> ? "integer" : "number",
                                                     " value"));
    }
    out->push_back(v.get<T>());
  }
  return absl::OkStatus();
}

absl::StatusOr<SampleRecord> ParseSample(const json& entry, const std::string& where) {
  if (!entry.is_object()) return absl::InvalidArgumentError(where + ": not an object");
  SampleRecord r;
  auto text = [&](const char* field, std::string* out) -> absl::Status {
    auto it = entry.find(field);
    if (it == entry.end() || !it->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"", field, "\" must be a string"));
    }
    *out = it->get<std::string>();
    return absl::OkStatus();
  };
  if (absl::Status s = text("task", &r.key.task); !s.ok()) return s;
  if (absl::Status s = text("policy", &r.key.policy); !s.ok()) return s;
  auto context = entry.find("context");
  auto seed = entry.find("seed");
  auto correct = entry.find("correct");
  if (context == entry.end() || !context->is_number_integer() || seed == entry.end() ||
      !seed->is_number_unsigned() || correct == entry.end() || !correct->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": needs integer \"context\", unsigned \"seed\", boolean \"correct\""));
  }
  r.key.context = context->get<int64_t>();
  r.key.seed = seed->get<uint64_t>();
  r.correct = correct->get<bool>();
  const std::string named = absl::StrCat(where, " (", KeyText(r.key), ")");
  if (absl::Status s = NumberArray(entry, "tokens", named, &r.tokens); !s.ok()) return s;
  if (absl::Status s = NumberArray(entry, "margins", named, &r.margins); !s.ok()) return s;
  if (absl::Status s = NumberArray(entry, "top_logits", named, &r.top_logits); !s.ok()) return s;
  if (r.margins.size() != r.tokens.size() || r.top_logits.size() != r.tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        named, ": ", r.tokens.size(), " tokens but ", r.margins.size(), " margins and ",
        r.top_logits.size(), " top logits (one of each per generated token)"));
  }
  return r;
}

// Folds the decode steps `a` and `b` share into `noise`: steps 1 .. (first differing step - 1);
// step 0 is the prefill's choice, the same computation in both runs.
void AddNoise(const SampleRecord& a, const SampleRecord& b, PolicyNoise* noise) {
  const size_t n = std::min(a.tokens.size(), b.tokens.size());
  for (size_t i = 1; i < n; ++i) {
    // Step i's logits were computed from tokens 0..i-1, so they are comparable while those agree.
    if (a.tokens[i - 1] != b.tokens[i - 1]) break;
    const double scale = std::max(1.0f, std::abs(a.top_logits[i]));
    noise->top_logit =
        std::max(noise->top_logit, std::abs(double(a.top_logits[i]) - b.top_logits[i]) / scale);
    noise->margin = std::max(noise->margin, std::abs(double(a.margins[i]) - b.margins[i]) / scale);
    ++noise->steps;
  }
}

// Compares one sample present in both runs.
SampleComparison CompareSample(const SampleRecord& a, const SampleRecord& b, double relative) {
  SampleComparison c;
  c.key = a.key;
  c.correct_a = a.correct;
  c.correct_b = b.correct;
  if (a.tokens == b.tokens) return c;
  const size_t n = std::min(a.tokens.size(), b.tokens.size());
  size_t step = 0;
  while (step < n && a.tokens[step] == b.tokens[step]) ++step;
  c.first_diff_step = static_cast<int64_t>(step);
  c.token_a = step < a.tokens.size() ? a.tokens[step] : -1;
  c.token_b = step < b.tokens.size() ? b.tokens[step] : -1;
  c.margin_b = step < b.margins.size() ? b.margins[step] : std::numeric_limits<float>::quiet_NaN();
  if (step >= a.tokens.size() || step >= b.tokens.size()) {
    // One run stopped where the other went on with the same tokens. A list ends after its
    // terminator, which the other run then chose too, so this one stopped at its token limit:
    // the runs had different limits (--max-new-tokens) and no greedy choice tells them apart.
    c.margin_a = std::numeric_limits<float>::quiet_NaN();
    c.verdict = Verdict::kDivergence;
    return c;
  }
  c.margin_a = a.margins[step];
  c.top_logit_a = a.top_logits[step];
  c.threshold = static_cast<float>(relative * std::max(1.0f, std::abs(c.top_logit_a)));
  c.verdict = c.margin_a <= c.threshold ? Verdict::kNearTie : Verdict::kDivergence;
  return c;
}

std::string FormatFloat(float x) {
  if (std::isnan(x)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4f", x);
  return buf;
}

// A token as a reader wants it: the byte as a character where printable.
std::string TokenText(int32_t t) {
  if (t < 0) return "(end)";
  if (t >= 0x21 && t < 0x7f) return absl::StrCat("'", std::string(1, static_cast<char>(t)), "'");
  if (t == '\n') return "'\\n'";
  return absl::StrCat(t);
}

void PrintComparison(const EvalComparison& c, const std::string& path_a,
                     const std::string& path_b) {
  std::printf("A: %s (device %s)   B: %s (device %s)\n", path_a.c_str(), c.device_a.c_str(),
              path_b.c_str(), c.device_b.c_str());
  std::printf(
      "%zu paired samples: %lld identical, %lld differ (%lld near-ties, %lld divergences); "
      "%lld scored differently\n",
      c.samples.size(), static_cast<long long>(c.identical),
      static_cast<long long>(c.near_ties + c.divergences), static_cast<long long>(c.near_ties),
      static_cast<long long>(c.divergences), static_cast<long long>(c.correct_flips));
  std::printf(
      "near-tie: A's top-2 margin at the first differing step <= %.3g x max(1, |top "
      "logit|)\n",
      c.near_tie_relative);
  std::printf(
      "measured noise where both runs were fed the same tokens (max difference / max(1, "
      "|top logit|)):\n");
  for (const PolicyNoise& n : c.noise) {
    std::printf("  %-18s %7lld steps   top logit %.2e   margin %.2e\n", n.policy.c_str(),
                static_cast<long long>(n.steps), n.top_logit, n.margin);
  }
  if (!c.only_a.empty() || !c.only_b.empty()) {
    std::printf("unpaired: %zu only in A, %zu only in B (e.g. %s)\n", c.only_a.size(),
                c.only_b.size(),
                KeyText(!c.only_a.empty() ? c.only_a.front() : c.only_b.front()).c_str());
  }
  std::printf("accuracy over the paired samples (B - A, 95%% interval):\n");
  for (const PolicyAccuracy& a : c.accuracy) {
    std::printf("  %-22s n %5lld   A %.3f   B %.3f   lost %lld gained %lld   %+.3f [%+.3f, %+.3f]\n",
                a.policy.c_str(), static_cast<long long>(a.n),
                a.n > 0 ? static_cast<double>(a.correct_a) / a.n : 0.0,
                a.n > 0 ? static_cast<double>(a.correct_b) / a.n : 0.0,
                static_cast<long long>(a.lost), static_cast<long long>(a.gained), a.delta,
                a.delta_low, a.delta_high);
  }
  if (c.near_ties + c.divergences == 0) return;
  std::printf("\n%-16s %7s %9s  %-18s %-7s %-7s %5s %7s %7s %9s %9s %9s  %s\n", "task", "context",
              "seed", "policy", "A", "B", "step", "tok A", "tok B", "margin A", "threshold",
              "margin B", "verdict");
  for (const SampleComparison& s : c.samples) {
    if (s.verdict == Verdict::kIdentical) continue;
    std::printf(
        "%-16s %7lld %9llu  %-18s %-7s %-7s %5lld %7s %7s %9s %9s %9s  %s\n", s.key.task.c_str(),
        static_cast<long long>(s.key.context), static_cast<unsigned long long>(s.key.seed),
        s.key.policy.c_str(), s.correct_a ? "ok" : "wrong", s.correct_b ? "ok" : "wrong",
        static_cast<long long>(s.first_diff_step), TokenText(s.token_a).c_str(),
        TokenText(s.token_b).c_str(), FormatFloat(s.margin_a).c_str(),
        FormatFloat(s.threshold).c_str(), FormatFloat(s.margin_b).c_str(), VerdictName(s.verdict));
  }
}

absl::StatusOr<json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  json doc = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not valid JSON"));
  }
  return doc;
}

// JSON numbers cannot be NaN: null stands for "none".
json FloatOrNull(float x) { return std::isnan(x) ? json(nullptr) : json(x); }

}  // namespace

const char* VerdictName(Verdict v) {
  switch (v) {
    case Verdict::kIdentical:
      return "identical";
    case Verdict::kNearTie:
      return "near-tie";
    case Verdict::kDivergence:
      return "divergence";
  }
  return "?";
}

absl::StatusOr<EvalRun> ParseEvalRun(const json& doc, const std::string& name) {
  if (!doc.is_object()) return absl::InvalidArgumentError(name + ": not a JSON object");
  auto samples = doc.find("samples");
  if (samples == doc.end() || !samples->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name,
                     " has no per-sample records (\"samples\"); write it with `fluxion eval tasks "
                     "--json` of this version"));
  }
  EvalRun run;
  run.device = "cpu";
  if (auto d = doc.find("device"); d != doc.end()) {
    if (!d->is_string()) return absl::InvalidArgumentError(name + ": \"device\" is not a string");
    run.device = d->get<std::string>();
  }
  absl::flat_hash_map<SampleKey, size_t, KeyHash> seen;
  for (size_t i = 0; i < samples->size(); ++i) {
    absl::StatusOr<SampleRecord> r = ParseSample((*samples)[i], absl::StrCat(name, " sample ", i));
    if (!r.ok()) return r.status();
    if (!seen.emplace(r->key, i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": sample ", KeyText(r->key), " is listed twice"));
    }
    run.samples.push_back(*std::move(r));
  }
  return run;
}

absl::StatusOr<EvalRun> MergeEvalRuns(const std::vector<EvalRun>& parts) {
  EvalRun merged;
  if (parts.empty()) return merged;
  merged.device = parts[0].device;
  absl::flat_hash_map<SampleKey, bool, KeyHash> seen;
  for (const EvalRun& part : parts) {
    if (part.device != merged.device) {
      return absl::InvalidArgumentError(
          absl::StrCat("the files of one side ran on different devices (", merged.device, " and ",
                       part.device, ")"));
    }
    for (const SampleRecord& r : part.samples) {
      if (!seen.emplace(r.key, true).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("sample ", KeyText(r.key), " is in two files of one side"));
      }
      merged.samples.push_back(r);
    }
  }
  return merged;
}

EvalComparison CompareEvalRuns(const EvalRun& a, const EvalRun& b, const CompareOptions& options) {
  EvalComparison c;
  c.device_a = a.device;
  c.device_b = b.device;
  c.near_tie_relative = options.near_tie_relative;
  absl::flat_hash_map<SampleKey, const SampleRecord*, KeyHash> in_b;
  for (const SampleRecord& r : b.samples) in_b[r.key] = &r;
  absl::flat_hash_map<SampleKey, bool, KeyHash> paired;
  for (const SampleRecord& r : a.samples) {
    auto it = in_b.find(r.key);
    if (it == in_b.end()) {
      c.only_a.push_back(r.key);
      continue;
    }
    paired[r.key] = true;
    auto noise = std::find_if(c.noise.begin(), c.noise.end(),
                              [&](const PolicyNoise& n) { return n.policy == r.key.policy; });
    if (noise == c.noise.end()) {
      c.noise.push_back({r.key.policy});
      noise = c.noise.end() - 1;
    }
    AddNoise(r, *it->second, &*noise);
    SampleComparison s = CompareSample(r, *it->second, options.near_tie_relative);
    c.identical += s.verdict == Verdict::kIdentical;
    c.near_ties += s.verdict == Verdict::kNearTie;
    c.divergences += s.verdict == Verdict::kDivergence;
    c.correct_flips += s.correct_a != s.correct_b;
    auto acc = std::find_if(c.accuracy.begin(), c.accuracy.end(),
                            [&](const PolicyAccuracy& p) { return p.policy == r.key.policy; });
    if (acc == c.accuracy.end()) {
      c.accuracy.push_back({r.key.policy});
      acc = c.accuracy.end() - 1;
    }
    ++acc->n;
    acc->correct_a += s.correct_a;
    acc->correct_b += s.correct_b;
    acc->lost += s.correct_a && !s.correct_b;
    acc->gained += !s.correct_a && s.correct_b;
    c.samples.push_back(std::move(s));
  }
  for (PolicyAccuracy& a : c.accuracy) {
    a.delta = a.n > 0 ? static_cast<double>(a.gained - a.lost) / a.n : 0.0;
    const Interval i = PairedDifference95(a.lost, a.gained, a.n);
    a.delta_low = i.low;
    a.delta_high = i.high;
  }
  for (const SampleRecord& r : b.samples) {
    if (!paired.contains(r.key)) c.only_b.push_back(r.key);
  }
  return c;
}

void SplitGuardPairs(EvalRun* a, EvalRun* b) {
  std::vector<SampleRecord> kept;
  for (SampleRecord& r : a->samples) {
    if (!absl::EndsWith(r.key.policy, "+guard")) kept.push_back(std::move(r));
  }
  a->samples = std::move(kept);
  kept.clear();
  for (SampleRecord& r : b->samples) {
    if (!absl::EndsWith(r.key.policy, "+guard")) continue;
    r.key.policy.resize(r.key.policy.size() - std::string("+guard").size());
    kept.push_back(std::move(r));
  }
  b->samples = std::move(kept);
}

json ComparisonJson(const EvalComparison& c) {
  auto keys = [](const std::vector<SampleKey>& list) {
    json out = json::array();
    for (const SampleKey& k : list) {
      out.push_back(
          {{"task", k.task}, {"context", k.context}, {"seed", k.seed}, {"policy", k.policy}});
    }
    return out;
  };
  json differing = json::array();
  for (const SampleComparison& s : c.samples) {
    if (s.verdict == Verdict::kIdentical) continue;
    differing.push_back({{"task", s.key.task},
                         {"context", s.key.context},
                         {"seed", s.key.seed},
                         {"policy", s.key.policy},
                         {"verdict", VerdictName(s.verdict)},
                         {"correct_a", s.correct_a},
                         {"correct_b", s.correct_b},
                         {"first_diff_step", s.first_diff_step},
                         {"token_a", s.token_a},
                         {"token_b", s.token_b},
                         {"margin_a", FloatOrNull(s.margin_a)},
                         {"top_logit_a", s.top_logit_a},
                         {"threshold", s.threshold},
                         {"margin_b", FloatOrNull(s.margin_b)}});
  }
  json noise = json::array();
  for (const PolicyNoise& n : c.noise) {
    noise.push_back({{"policy", n.policy},
                     {"steps", n.steps},
                     {"top_logit", n.top_logit},
                     {"margin", n.margin}});
  }
  json accuracy = json::array();
  for (const PolicyAccuracy& a : c.accuracy) {
    accuracy.push_back({{"policy", a.policy}, {"n", a.n}, {"correct_a", a.correct_a},
                        {"correct_b", a.correct_b}, {"lost", a.lost}, {"gained", a.gained},
                        {"delta", a.delta}, {"delta_ci_low", a.delta_low},
                        {"delta_ci_high", a.delta_high}});
  }
  return {{"device_a", c.device_a},
          {"device_b", c.device_b},
          {"near_tie_relative", c.near_tie_relative},
          {"paired", c.samples.size()},
          {"identical", c.identical},
          {"near_ties", c.near_ties},
          {"divergences", c.divergences},
          {"correct_flips", c.correct_flips},
          {"only_in_a", keys(c.only_a)},
          {"only_in_b", keys(c.only_b)},
          {"noise", noise},
          {"accuracy", accuracy},
          {"differing", differing}};
}

int RunEvalCompareCommand(const std::vector<std::string>& args) {
  // Two positional files first, then flags.
  std::vector<std::string> files, rest;
  for (const std::string& a : args) {
    (files.size() < 2 && !absl::StartsWith(a, "--") ? files : rest).push_back(a);
  }
  std::string json_path;
  double near_tie = CompareOptions().near_tie_relative;
  FlagSet flags("fluxion eval compare A.json B.json",
                "Compares two `fluxion eval tasks --json` runs over the same seeds sample by "
                "sample (A is the reference, e.g. --device cpu; each side may be a comma-separated "
                "list of files): identical outputs, near-ties "
                "(the first differing token was a near-tie in A) and divergences. Exit 0 when "
                "nothing diverges, 1 when something does.");
  flags.String("json", &json_path, "also write the comparison to this file");
  bool guard_pairs = false;
  flags.Bool("guard-pairs", &guard_pairs,
             "pair each policy of A without the error guard with itself under the guard in B "
             "(`NAME@BUDGET+guard`; A and B may be the same `--guard both` run); divergences are "
             "then expected and do not fail the command");
  flags.Double("near-tie", &near_tie,
               "a differing token is a near-tie when A's top-2 logit margin there is at most "
               "this times max(1, |A's top logit|)");
  if (int rc = ParseFlagsOrExit(flags, rest); rc >= 0) return rc;
  if (files.size() != 2) {
    std::cerr << "error: give two eval JSON files (fluxion eval tasks --json)\n" << flags.Usage();
    return 2;
  }
  if (!(near_tie >= 0)) {
    std::cerr << "error: --near-tie must be >= 0\n";
    return 2;
  }
  EvalRun runs[2];
  for (int i = 0; i < 2; ++i) {
    std::vector<EvalRun> parts;
    for (absl::string_view path : absl::StrSplit(files[i], ',', absl::SkipEmpty())) {
      const std::string name(path);
      absl::StatusOr<json> doc = ReadJsonFile(name);
      absl::StatusOr<EvalRun> run =
          doc.ok() ? ParseEvalRun(*doc, name) : absl::StatusOr<EvalRun>(doc.status());
      if (!run.ok()) {
        std::cerr << "error: " << run.status().message() << "\n";
        return 1;
      }
      parts.push_back(*std::move(run));
    }
    absl::StatusOr<EvalRun> merged = MergeEvalRuns(parts);
    if (!merged.ok()) {
      std::cerr << "error: " << (i == 0 ? "A" : "B") << ": " << merged.status().message() << "\n";
      return 1;
    }
    runs[i] = *std::move(merged);
  }
  if (guard_pairs) SplitGuardPairs(&runs[0], &runs[1]);
  CompareOptions options;
  options.near_tie_relative = near_tie;
  const EvalComparison c = CompareEvalRuns(runs[0], runs[1], options);
  PrintComparison(c, files[0], files[1]);
  if (!json_path.empty()) {
    json out = ComparisonJson(c);
    out["a"] = files[0];
    out["b"] = files[1];
    if (absl::Status s = bench::WriteJson(json_path, out); !s.ok()) {
      std::cerr << "error: " << s.message() << "\n";
      return 1;
    }
    std::cerr << "wrote " << json_path << "\n";
  }
  return c.divergences > 0 && !guard_pairs ? 1 : 0;
}

}  // namespace fluxion::eval
