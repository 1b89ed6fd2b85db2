#include "decode/sparse/decision_profile.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "decode/sparse/granularity.h"
#include "nlohmann/json.hpp"

namespace fluxion::decode::sparse {
namespace {

using nlohmann::json;

// Shares are sums of counts divided by their total, written with 17 digits: a file that went
// through Serialize sums to 1 far inside this; a hand-written one may round to 3 digits.
constexpr double kShareTolerance = 1e-3;

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("decision profile: ", what));
}

absl::StatusOr<double> Number(const json& obj, const std::string& key, const std::string& where) {
  if (!obj.contains(key) || !obj[key].is_number()) {
    return Bad(absl::StrCat(where, key, " must be a number"));
  }
  const double v = obj[key].get<double>();
  if (!std::isfinite(v)) return Bad(absl::StrCat(where, key, " is not finite"));
  return v;
}

absl::StatusOr<int64_t> Integer(const json& obj, const std::string& key, const std::string& where,
                                int64_t min, int64_t max) {
  if (!obj.contains(key) || !obj[key].is_number_integer()) {
    return Bad(absl::StrCat(where, key, " must be an integer"));
  }
  const int64_t v = obj[key].get<int64_t>();
  if (v < min || v > max) {
    return Bad(absl::StrCat(where, key, " is ", v, ", outside [", min, ", ", max, "]"));
  }
  return v;
}

absl::StatusOr<double> Share(const json& obj, const std::string& key, const std::string& where) {
  FLUXION_ASSIGN_OR_RETURN(double v, Number(obj, key, where));
  if (v < 0.0 || v > 1.0) return Bad(absl::StrCat(where, key, " is ", v, ", outside [0, 1]"));
  return v;
}

absl::StatusOr<double> Budget(const json& obj, const std::string& key, const std::string& where) {
  FLUXION_ASSIGN_OR_RETURN(double v, Number(obj, key, where));
  if (!(v > 0.0 && v <= 1.0)) {
    return Bad(absl::StrCat(where, key, " is ", v, ", outside (0, 1]"));
  }
  return v;
}

bool SupportedBlock(const std::string& policy, int64_t block) {
  if (policy == "lfps") return block == kTokenLevelBlock;
  return std::find(std::begin(kFluxionBlocks), std::end(kFluxionBlocks), block) !=
         std::end(kFluxionBlocks);
}

std::string BlocksOf(const std::string& policy) {
  if (policy == "lfps") return "1 (LFPS selects tokens)";
  return absl::StrCat(absl::StrJoin(std::begin(kFluxionBlocks), std::end(kFluxionBlocks), ", "),
                      " (Fluxion's scan blocks)");
}

absl::StatusOr<PolicyDecisions> ParseDecisions(const json& p, const std::string& where) {
  if (!p.is_object()) return Bad(absl::StrCat(where, " must be an object"));
  PolicyDecisions d;
  if (!p.contains("policy") || !p["policy"].is_string()) {
    return Bad(absl::StrCat(where, "policy must be a string"));
  }
  d.policy = p["policy"].get<std::string>();
  if (d.policy != "lfps" && d.policy != "fluxion") {
    return Bad(absl::StrCat(where, "policy is '", d.policy, "'; profiles hold lfps and fluxion"));
  }
  FLUXION_ASSIGN_OR_RETURN(d.policy_budget, Budget(p, "policy_budget", where));
  FLUXION_ASSIGN_OR_RETURN(d.sink_tokens, Integer(p, "sink_tokens", where, 0, 1 << 20));
  FLUXION_ASSIGN_OR_RETURN(d.local_tokens, Integer(p, "local_tokens", where, 0, 1 << 20));
  FLUXION_ASSIGN_OR_RETURN(d.context, Integer(p, "context", where, 1, int64_t{1} << 31));
  FLUXION_ASSIGN_OR_RETURN(d.head_steps, Integer(p, "head_steps", where, 1, int64_t{1} << 62));
  FLUXION_ASSIGN_OR_RETURN(d.streaming_share, Share(p, "streaming_share", where));
  FLUXION_ASSIGN_OR_RETURN(d.bypass_share, Share(p, "bypass_share", where));
  if (d.streaming_share + d.bypass_share > 1.0 + kShareTolerance) {
    return Bad(absl::StrCat(where, "streaming_share + bypass_share is ",
                            d.streaming_share + d.bypass_share, ", more than 1"));
  }
  // Weights are budgets over the uniform middle budget at the recorded context: it must exist.
  const int64_t window = d.sink_tokens + d.local_tokens;
  if (std::ceil(d.policy_budget * d.context) <= window) {
    return Bad(absl::StrCat(where, "at context ", d.context, " and policy_budget ", d.policy_budget,
                            " the budget leaves nothing beyond sinks + window ", "(", window,
                            " tokens): record at a longer context"));
  }
  if (!p.contains("retrieval") || !p["retrieval"].is_array()) {
    return Bad(absl::StrCat(where, "retrieval must be an array"));
  }
  double total = 0;
  for (size_t i = 0; i < p["retrieval"].size(); ++i) {
    const json& r = p["retrieval"][i];
    const std::string at = absl::StrCat(where, "retrieval[", i, "].");
    if (!r.is_object()) return Bad(absl::StrCat(at.substr(0, at.size() - 1), " must be an object"));
    RetrievalChoice c;
    FLUXION_ASSIGN_OR_RETURN(c.block_tokens, Integer(r, "block_tokens", at, 1, 1 << 20));
    if (!SupportedBlock(d.policy, c.block_tokens)) {
      return Bad(absl::StrCat(at, "block_tokens is ", c.block_tokens, "; ", d.policy, " supports ",
                              BlocksOf(d.policy)));
    }
    FLUXION_ASSIGN_OR_RETURN(c.budget, Budget(r, "budget", at));
    FLUXION_ASSIGN_OR_RETURN(c.share, Share(r, "share", at));
    total += c.share;
    d.retrieval.push_back(c);
  }
  if (p.contains("rescored_share")) {
    FLUXION_ASSIGN_OR_RETURN(d.rescored_share, Share(p, "rescored_share", where));
  }
  const bool any_retrieval = d.streaming_share + d.bypass_share < 1.0 - kShareTolerance;
  if (any_retrieval && std::abs(total - 1.0) > kShareTolerance) {
    return Bad(absl::StrCat(where, "retrieval shares sum to ", total, ", not 1"));
  }
  return d;
}

json DecisionsToJson(const PolicyDecisions& d) {
  json retrieval = json::array();
  for (const RetrievalChoice& c : d.retrieval) {
    retrieval.push_back(
        {{"block_tokens", c.block_tokens}, {"budget", c.budget}, {"share", c.share}});
  }
  json out = {{"policy", d.policy},
              {"policy_budget", d.policy_budget},
              {"context", d.context},
              {"sink_tokens", d.sink_tokens},
              {"local_tokens", d.local_tokens},
              {"head_steps", d.head_steps},
              {"streaming_share", d.streaming_share},
              {"bypass_share", d.bypass_share},
              {"retrieval", retrieval}};
  // Written only when recorded, so that a profile made before the field reads back unchanged.
  if (d.rescored_share > 0) out["rescored_share"] = d.rescored_share;
  return out;
}

uint64_t Mix(uint64_t x) {  // splitmix64's finaliser: every input bit reaches every output bit
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A uniform draw in [0, 1) from the hash of its keys.
double Uniform(uint64_t seed, uint64_t salt, int layer, int kv_head, int64_t step) {
  uint64_t h = Mix(seed ^ (salt * 0x632be59bd9b4e019ULL));
  h = Mix(h ^ static_cast<uint64_t>(layer));
  h = Mix(h ^ static_cast<uint64_t>(kv_head));
  h = Mix(h ^ static_cast<uint64_t>(step));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

constexpr uint64_t kSaltClass = 1, kSaltChoice = 2, kSaltBypass = 3;

}  // namespace

DecisionProfile DecisionProfile::Conservative() {
  DecisionProfile p;
  p.name_ = kConservativeProfile;
  p.conservative_ = true;
  return p;
}

absl::StatusOr<DecisionProfile> DecisionProfile::Parse(absl::string_view json_text) {
  const json doc = json::parse(json_text.begin(), json_text.end(), nullptr,
                               /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return Bad("not valid JSON, or not a JSON object");
  if (!doc.contains("format") || !doc["format"].is_string() ||
      doc["format"].get<std::string>() != kDecisionProfileFormat) {
    return Bad(absl::StrCat("format must be \"", kDecisionProfileFormat, "\""));
  }
  DecisionProfile p;
  if (!doc.contains("name") || !doc["name"].is_string() || doc["name"].get<std::string>().empty()) {
    return Bad("name must be a non-empty string");
  }
  p.name_ = doc["name"].get<std::string>();
  if (p.name_ == kConservativeProfile) {
    return Bad("name 'conservative' is the built-in profile's; choose another");
  }
  if (!doc.contains("seed") || !doc["seed"].is_number_unsigned()) {
    return Bad("seed must be a non-negative integer");
  }
  p.seed_ = doc["seed"].get<uint64_t>();
  if (doc.contains("source")) {
    if (!doc["source"].is_object()) return Bad("source must be an object");
    p.source_json_ = doc["source"].dump();
  }
  if (!doc.contains("policies") || !doc["policies"].is_array() || doc["policies"].empty()) {
    return Bad("policies must be a non-empty array");
  }
  for (size_t i = 0; i < doc["policies"].size(); ++i) {
    FLUXION_ASSIGN_OR_RETURN(
        PolicyDecisions d, ParseDecisions(doc["policies"][i], absl::StrCat("policies[", i, "].")));
    for (const PolicyDecisions& e : p.policies_) {
      if (e.policy == d.policy && e.policy_budget == d.policy_budget) {
        return Bad(absl::StrCat("policies[", i, "] repeats ", d.policy, " at policy_budget ",
                                d.policy_budget));
      }
    }
    p.policies_.push_back(std::move(d));
  }
  return p;
}

absl::StatusOr<DecisionProfile> DecisionProfile::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open decision profile ", path, " (or pass --profile conservative)"));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<DecisionProfile> p = Parse(text.str());
  if (!p.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", p.status().message()));
  }
  return p;
}

absl::StatusOr<std::shared_ptr<const DecisionProfile>> DecisionProfile::Resolve(
    const std::string& flag) {
  if (flag == kConservativeProfile) {
    return std::make_shared<const DecisionProfile>(Conservative());
  }
  FLUXION_ASSIGN_OR_RETURN(DecisionProfile p, Load(flag));
  return std::make_shared<const DecisionProfile>(std::move(p));
}

std::string DecisionProfile::Serialize() const {
  json policies = json::array();
  for (const PolicyDecisions& d : policies_) policies.push_back(DecisionsToJson(d));
  json source = json::parse(source_json_, nullptr, /*allow_exceptions=*/false);
  if (source.is_discarded()) source = json::object();
  const json doc = {{"format", kDecisionProfileFormat},
                    {"name", name_},
                    {"seed", seed_},
                    {"source", source},
                    {"policies", policies}};
  return doc.dump(1) + "\n";
}

absl::StatusOr<PolicyDecisions> DecisionProfile::For(const PolicyConfig& config) const {
  std::string policy;
  if (config.kind == PolicyKind::kLfps) policy = "lfps";
  if (config.kind == PolicyKind::kFluxion) policy = "fluxion";
  if (policy.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("decision profiles replay lfps and fluxion; ",
                                                   config.name, " decides without one"));
  }
  if (conservative_) {
    PolicyDecisions d;
    d.policy = policy;
    d.policy_budget = config.budget;
    d.sink_tokens = config.sink_tokens;
    d.local_tokens = config.local_tokens;
    d.retrieval.push_back(
        {policy == "lfps" ? kTokenLevelBlock : kFluxionBlocks[0], config.budget, 1.0});
    return d;
  }
  std::vector<std::string> have;
  for (const PolicyDecisions& d : policies_) {
    if (d.policy != policy) continue;
    // Budgets come from flags and files as decimals: equal to a few ulps.
    if (std::abs(d.policy_budget - config.budget) <= 1e-9) return d;
    have.push_back(absl::StrCat(d.policy_budget));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "decision profile '", name_, "' has no ", policy, " at budget ", config.budget,
      have.empty() ? std::string(" (none at any budget)")
                   : absl::StrCat(" (it has ", absl::StrJoin(have, ", "), ")"),
      ": record one with fluxion eval tasks --record-profile, or use --profile conservative"));
}

HeadReplay DecisionProfile::DrawHead(const PolicyDecisions& d, int layer, int kv_head) const {
  HeadReplay h;
  if (Uniform(seed_, kSaltClass, layer, kv_head, 0) < d.streaming_share) {
    h.streaming = true;
    h.weight = 0;
    return h;
  }
  if (d.retrieval.empty()) return h;  // every non-streaming head-step bypasses
  const double u = Uniform(seed_, kSaltChoice, layer, kv_head, 0);
  double cumulative = 0;
  const RetrievalChoice* pick = &d.retrieval.back();  // u beyond the rounded total
  for (const RetrievalChoice& c : d.retrieval) {
    cumulative += c.share;
    if (u < cumulative) {
      pick = &c;
      break;
    }
  }
  h.block_tokens = pick->block_tokens;
  if (d.context == 0) {
    h.weight = pick->budget / d.policy_budget;  // built in: budgets are at the configured one
  } else {
    // Rows beyond sinks + window at the recorded context, over the uniform policy's.
    const double window = static_cast<double>(d.sink_tokens + d.local_tokens);
    const double uniform = std::ceil(d.policy_budget * d.context) - window;
    h.weight = std::max(0.0, (pick->budget * d.context - window) / uniform);
  }
  return h;
}

bool DecisionProfile::DrawBypass(const PolicyDecisions& d, int layer, int kv_head,
                                 int64_t step) const {
  // bypass_share is of all head-steps; streaming heads never reach the test.
  const double rest = 1.0 - d.streaming_share;
  if (rest <= 0 || d.bypass_share <= 0) return false;
  return Uniform(seed_, kSaltBypass, layer, kv_head, step) < d.bypass_share / rest;
}

bool RecordedInProfiles(const PolicyConfig& config) {
  return config.kind == PolicyKind::kLfps || config.kind == PolicyKind::kFluxion;
}

void DecisionRecorder::Add(const PolicyConfig& config, const SelectionStats& stats) {
  if (!RecordedInProfiles(config)) return;
  Totals& t = totals_[{config.name, config.budget}];
  t.config = config;
  t.stats.Add(stats);
}

absl::StatusOr<DecisionProfile> DecisionRecorder::Build(const std::string& name,
                                                        const std::string& source_json) const {
  DecisionProfile p;
  p.name_ = name;
  p.source_json_ = source_json;
  for (const auto& [key, t] : totals_) {
    const SelectionStats& s = t.stats;
    if (s.selections == 0) continue;
    PolicyDecisions d;
    d.policy = t.config.name;
    d.policy_budget = t.config.budget;
    d.sink_tokens = t.config.sink_tokens;
    d.local_tokens = t.config.local_tokens;
    d.context = s.context / s.selections;
    d.head_steps = s.selections;
    d.streaming_share = static_cast<double>(s.streaming) / s.selections;
    d.bypass_share = static_cast<double>(s.bypassed) / s.selections;
    if (s.candidate_context > 0) {
      d.rescored_share = std::min(
          1.0, static_cast<double>(s.candidate_rows) / static_cast<double>(s.candidate_context));
    }
    // Budgets binned to 0.001 of the context: Fluxion's per-request weight normalisation makes
    // nearly every request's budgets distinct at kBudgetUnit.
    std::map<std::pair<int64_t, int64_t>, int64_t> bins;
    int64_t retrieval = 0;
    for (const auto& [choice, n] : s.retrieval) {
      const int64_t milli = std::max<int64_t>(1, std::llround(choice.second * kBudgetUnit * 1e3));
      bins[{choice.first, std::min<int64_t>(milli, 1000)}] += n;
      retrieval += n;
    }
    for (const auto& [choice, n] : bins) {
      d.retrieval.push_back({choice.first, static_cast<double>(choice.second) / 1000.0,
                             static_cast<double>(n) / static_cast<double>(retrieval)});
    }
    p.policies_.push_back(std::move(d));
  }
  if (p.policies_.empty()) {
    return absl::FailedPreconditionError(
        "no lfps or fluxion decode steps were recorded: --record-profile needs --policy lfps "
        "and/or fluxion");
  }
  // What it writes must read back: the same checks a loaded file gets.
  FLUXION_RETURN_IF_ERROR(DecisionProfile::Parse(p.Serialize()).status());
  return p;
}

}  // namespace fluxion::decode::sparse
