// Decision profiles: what the data-driven policies (`lfps`, `fluxion`) decide, stated up front so
// that they can be timed where their decisions would mean nothing.
//
// On random weights and random KV attention has no structure, so what LFPS and Fluxion decide
// there (which heads stream, which head-steps bypass to sinks + window, each head's budget and
// block size) says nothing about a real model and can make a policy look arbitrarily fast. Under
// a profile (PolicyConfig::decision_profile) the two policies take those decisions from the
// profile instead, by deterministic draws, and keep their own selection and attention mechanics
// (the sparsity estimate, LFPS's table candidates and refreshes, Fluxion's query-aware block
// scan), so what is timed is the policies' own work at the profile's decision shares:
//
//   - conservative (built in): every head a retrieval head spending the full budget, no bypass,
//     no streaming; Fluxion at its finest block (16 tokens: the largest metadata scan);
//   - measured (a JSON file, bench/profiles/): the shares `fluxion eval tasks --record-profile`
//     saw the policies choose on the trained model.
//
// Per policy (and the budget it ran at) a profile holds the share of head-steps that read only
// sinks + window because the head is streaming (a zero middle budget: Fluxion's streaming heads),
// the share bypassed by LFPS's sparsity test (both policies have it), and the distribution of
// (block size, budget) over the remaining, retrieval head-steps. A budget is what
// PolicyConfig::budget means (the fraction of the context the head-step attends, sinks and the
// window included) at the context the profile was recorded at; replay turns it into the head's
// share of the uniform middle budget (Fluxion's per-head weight, fluxion_policy.h) so that a
// profile recorded at 4K keeps the policy's proportions at 128K.
//
// Draws: a head's class (streaming or not) and its (block, budget) are drawn once per (layer,
// KV head) from a hash of (seed, layer, KV head), as the trained model's heads keep theirs; a
// bypass is drawn per head-step from a hash of (seed, layer, KV head, step). Runs are
// repeatable, and over many heads and steps the shares converge to the profile's. Every request
// of a run sees the same draws, as every request of a real model sees the same heads.
//
// File format (docs/SPARSE.md, "Decision profiles"):
//   {"format": "fluxion-decision-profile/v1", "name": "...", "seed": 1, "source": {...},
//    "policies": [{"policy": "fluxion", "policy_budget": 0.05, "context": 3900,
//                  "sink_tokens": 4, "local_tokens": 64, "head_steps": 123456,
//                  "streaming_share": 0.3, "bypass_share": 0.05,
//                  "retrieval": [{"block_tokens": 16, "budget": 0.08, "share": 0.6}, ...],
//                  "rescored_share": 0.21}]}       (optional: absent in files made before it)
//
// Thread-safe: immutable after construction.
#ifndef FLUXION_DECODE_SPARSE_DECISION_PROFILE_H_
#define FLUXION_DECODE_SPARSE_DECISION_PROFILE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "decode/sparse/policy.h"

namespace fluxion::decode::sparse {

inline constexpr char kDecisionProfileFormat[] = "fluxion-decision-profile/v1";
inline constexpr char kConservativeProfile[] = "conservative";
// LFPS selects single tokens: its retrieval choices carry this block size.
inline constexpr int64_t kTokenLevelBlock = 1;

struct RetrievalChoice {
  int64_t block_tokens = 16;  // Fluxion: its scan's block (16, 32 or 64); LFPS: 1
  double budget = 0;          // fraction of the context attended, in (0, 1]
  double share = 0;           // of the policy's retrieval head-steps; the shares sum to 1
};

struct PolicyDecisions {
  std::string policy;        // "lfps" or "fluxion"
  double policy_budget = 0;  // the policy's configured budget when recorded
  int64_t context = 0;       // mean context of the recorded head-steps (tokens); 0: built in
  int64_t sink_tokens = 4, local_tokens = 64;
  int64_t head_steps = 0;      // how many head-steps the shares come from (0: built in)
  double streaming_share = 0;  // of all head-steps: heads with no middle budget
  double bypass_share = 0;     // of all head-steps: bypassed by the sparsity test
  std::vector<RetrievalChoice> retrieval;
  // Rows a retrieval head-step rescored (its history candidates, expanded) over its context, on
  // the recorded model; 0: not recorded, the replaying policy keeps its own candidates. Random
  // weights fill LFPS's tables over the whole context (diffuse attention: every row a step
  // attends earns a table entry), so its candidates there hit the tables' caps (55% of a 128K
  // context at 8B shapes) where a trained model's tables hold what its heads
  // attended: the candidate volume is a decision of the model's attention like the others.
  // Replay thins a head-step's candidates to this share (never below its middle budget), after
  // the tables were selected and expanded as the policy does: the selection's own work stays
  // the random tables' (more than the model's), the rescoring is the model's.
  double rescored_share = 0;
};

// What replay decided for one (layer, KV head).
struct HeadReplay {
  bool streaming = false;
  int64_t block_tokens = 16;
  // The head's middle budget over the uniform one at the policy's budget (1: the full budget).
  double weight = 1.0;
};

class DecisionProfile {
 public:
  // Every head a retrieval head at the configured budget (Fluxion at 16-token blocks).
  static DecisionProfile Conservative();
  // InvalidArgument naming the field for malformed JSON, a wrong format, a share outside [0, 1],
  // a budget outside (0, 1], a block size the policy does not support, retrieval shares not
  // summing to 1, or a policy listed twice at one budget.
  static absl::StatusOr<DecisionProfile> Parse(absl::string_view json_text);
  // NotFound for a missing file, then as Parse (the message names the file).
  static absl::StatusOr<DecisionProfile> Load(const std::string& path);
  // `conservative` or the path of a profile file.
  static absl::StatusOr<std::shared_ptr<const DecisionProfile>> Resolve(const std::string& flag);

  // The JSON file format; Parse(Serialize()) gives an equal profile.
  std::string Serialize() const;

  const std::string& name() const { return name_; }
  bool conservative() const { return conservative_; }
  uint64_t seed() const { return seed_; }
  const std::vector<PolicyDecisions>& policies() const { return policies_; }

  // The decisions `config` replays: InvalidArgument for a policy other than lfps / fluxion, or
  // when the profile has no entry for the policy at config.budget (naming the budgets it has).
  absl::StatusOr<PolicyDecisions> For(const PolicyConfig& config) const;

  // The deterministic draws (see the header comment). `step`: the head-step's context length.
  HeadReplay DrawHead(const PolicyDecisions& d, int layer, int kv_head) const;
  bool DrawBypass(const PolicyDecisions& d, int layer, int kv_head, int64_t step) const;

 private:
  friend class DecisionRecorder;
  std::string name_;
  bool conservative_ = false;
  uint64_t seed_ = 1;
  std::string source_json_ = "{}";  // where a measured profile came from (kept verbatim)
  std::vector<PolicyDecisions> policies_;
};

// Whether a decision profile records `config`'s decisions: `lfps` and `fluxion`, not other
// policies (replay looks lfps / fluxion up by kind).
bool RecordedInProfiles(const PolicyConfig& config);

// A retrieval head-step's budget as SelectionStats::retrieval keys it: 1e-4 of the context.
inline constexpr double kBudgetUnit = 1e-4;

// Builds a measured profile from the policies' own decision counts (SelectionStats summed over
// decodes; configs RecordedInProfiles refuses are ignored).
class DecisionRecorder {
 public:
  void Add(const PolicyConfig& config, const SelectionStats& stats);
  // FailedPrecondition when nothing was recorded. `source_json`: a JSON object saying how the
  // profile was made (kept in the file verbatim).
  absl::StatusOr<DecisionProfile> Build(const std::string& name,
                                        const std::string& source_json) const;

 private:
  struct Totals {
    PolicyConfig config;
    SelectionStats stats;
  };
  std::map<std::pair<std::string, double>, Totals> totals_;  // by (policy name, budget)
};

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_DECISION_PROFILE_H_
