// Sparse attention policies: which K/V rows of a request's host pages a decode step attends, per
// (layer, KV head), for all query heads of the GQA group at once.
//
// Budget: the fraction of the context's tokens whose K/V rows the step attends, sinks and the
// local window included, so every policy is compared at equal attended reads. Sinks (the first
// `sink_tokens`) and the local window (the last `local_tokens`) are always attended densely; a
// policy chooses among the tokens between them. Policies that score keys read extra K rows for
// scoring; SelectionStats counts those separately.
//
// Thread-compatible: a policy object serves one request (later policies keep per-request history).
#ifndef FLUXION_DECODE_SPARSE_POLICY_H_
#define FLUXION_DECODE_SPARSE_POLICY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/error_guard.h"
#include "decode/sparse/granularity.h"
#include "kernels/compact_keys.h"
#include "kernels/paged_attention.h"
#include "model/output_projection.h"
#include "model/sparse_state.h"

namespace fluxion::decode::sparse {

class FluxionPredictor;  // decode/sparse/fluxion_predictor.h
class DecisionProfile;   // decode/sparse/decision_profile.h

// Which policy a config runs. A name is parsed into a kind once (ParsePolicy); everything that
// depends on the policy's identity asks the kind's traits instead of comparing names, so two
// places cannot disagree about, say, which policies need the prefill node's sparse state.
enum class PolicyKind {
  kFull,          // every row (the reference)
  kExactTopK,     // oracle: exact scores of every middle row, top rows
  kQuest,         // query-aware page bounds (Quest), top blocks
  kFixedBlock,    // fixed_<block>_<budget>: Quest scoring at a fixed block size and budget
  kLfps,          // LFPS with our streaming rule
  kLfpsPaper,     // LFPS with the published bypass rule
  kFluxion,       // per-head budgets from the trained predictor (rule fallback without one)
  kFluxionRules,  // Fluxion with the rule-based head properties only
};

struct PolicyTraits {
  const char* name;          // the name as users type it (fixed_<block>_<budget> as a pattern)
  bool budget_from_name;     // the budget is not a separate argument (full, fixed_*)
  bool needs_sparse_state;   // starts from the prefill node's captured sparse state
  bool uses_predictor;       // reads PolicyConfig::fluxion_predictor
  // Its state is independent per (layer, KV head): one object per KV head is the same policy.
  // False for Fluxion, whose budget allocation spans every head of the request: one object serves
  // them all. Either way a step selects (and completes) different KV heads of one request in
  // parallel: a shared object supports that once every head is prepared.
  bool heads_independent;
  // It ranks blocks by Quest's page-bound scores (PagedKv's key_min / key_max) at block size
  // RankedBlockTokens(): the hybrid step's device may compute those scores instead
  // (SelectionInput::block_scores). Fluxion ranks its blocks (16-64 tokens per head) by their
  // pages' scores, so its scores are per page.
  bool ranks_page_bounds;
  // The online error guard (error_guard.h) applies to it: its per-head budgets can move (LFPS,
  // Fluxion). The baselines keep their fixed budgets: --guard does not touch them.
  bool guardable;
  // Under the guard, a head measured far below tolerance may give budget back (a relaxation).
  // Fluxion: yes (its query-aware block scan finds what a head needs whatever it attended
  // before). LFPS: no: its candidates come from its own history, so a needle head that relaxes
  // attends fewer rows, drops its needles out of its tables and does not find them again
  // (measured: docs/SPARSE.md, "The online per-head error guard"). Escalations still apply.
  bool guard_relaxes;
  // Under Selector::kDevice it picks its middle rows as the top-k of compact-key scores
  // (decode/sparse/device_selection.h): exact_topk (k: the uniform budget, the whole middle),
  // Fluxion (k: the head's allocated budget, the whole middle) and LFPS (k: the uniform budget,
  // among its history tables' candidates). quest and fixed_* select as under kHost: they already
  // rank on the device (docs/SPARSE.md, "Device selection").
  bool device_selects;
  // A baseline kept for comparison, not for serving (quest, fixed_*, lfps_paper, fluxion_rules):
  // measuring commands run it beside the served policies; help texts say so.
  bool for_comparison;
};

const PolicyTraits& TraitsOf(PolicyKind kind);

// Where a policy's choice of rows is made (docs/SPARSE.md, "Device selection").
enum class Selector {
  // The policy's own selection over the host pages: exact scores of bf16 K rows, LFPS's tables,
  // Fluxion's candidates rescored exactly. The CPU decode path.
  kHost,
  // For kinds whose traits say device_selects: the k best middle rows by the score of the int8
  // compact keys the hybrid step keeps in HBM (kernels/compact_keys.h), picked on the GPU; without
  // one (the CPU path, `fluxion eval tasks --selector device`) the same rows are computed on the
  // CPU, bit for bit. Other kinds select as under kHost.
  kDevice,
};
// "host" / "device"; InvalidArgument naming both for anything else.
absl::StatusOr<Selector> ParseSelector(absl::string_view name);
const char* SelectorName(Selector selector);

struct PolicyConfig {
  // Set by ParsePolicy; a default-constructed config is `full`.
  PolicyKind kind = PolicyKind::kFull;
  // The name it was parsed from: full, exact_topk, quest, lfps, lfps_paper, fluxion,
  // fluxion_rules or fixed_<block>_<budget> (with its numbers); used for labels only.
  std::string name = "full";
  double budget = 1.0;        // fraction of context tokens attended; 1 for `full`
  int64_t sink_tokens = 4;
  int64_t local_tokens = 64;
  int64_t block_tokens = 16;  // selection granularity of block policies (multiple of page size)
  // `fluxion` only: the trained head-property predictor; null -> the rule-based fallback (which
  // `fluxion_rules` always uses). Shared, immutable.
  std::shared_ptr<const FluxionPredictor> fluxion_predictor;
  // `fluxion` / `fluxion_rules`: the host costs its granularity choice is calibrated with.
  HostCostModel host_cost;
  // `lfps` / `fluxion` only: when set, head classification, budget and block choice and the
  // bypass come from this profile's deterministic draws instead of the data (for timing at
  // shapes without a trained model; decision_profile.h). Shared, immutable. REQUIRES: the
  // profile has an entry for this policy at `budget` (DecisionProfile::For is OK).
  std::shared_ptr<const DecisionProfile> decision_profile;
  // The online error guard (error_guard.h); applies only where TraitsOf(kind).guardable, and
  // needs `output_projection` (the model's W_O, model/output_projection.h; shared, immutable).
  GuardConfig guard;
  std::shared_ptr<const model::OutputProjection> output_projection;
  // Where the rows are chosen; commands set it (--selector).
  Selector selector = Selector::kHost;
};

// Whether `config` picks its middle rows from compact keys (selector kDevice and a kind whose
// traits say device_selects).
bool DeviceSelects(const PolicyConfig& config);

// What a policy that selects from compact keys asks of a head-step (SparsePolicy::DevicePick):
// the pick.k rows of [pick.begin, pick.end) with the best compact scores, among `candidates` when
// set (bit j: position pick.begin + j, as CandidateMarks lays them out; pick.k at most the bits
// set), else among every row. pick.mask is the caller's: where it stages the candidates.
struct DeviceAsk {
  kernels::CompactPick pick;
  const std::vector<uint64_t>* candidates = nullptr;
};

// Whether `config` reads Quest page-bound scores: its kind ranks page bounds and it does not
// select from compact keys. The hybrid step's device computes them where it keeps the bounds.
bool ReadsPageScores(const PolicyConfig& config);

// Whether `config` decodes under the error guard (enabled, a guardable policy, a projection).
bool GuardActive(const PolicyConfig& config);
// The guard's configuration for `config`'s policy: config.guard, without relaxations where the
// kind does not take them (PolicyTraits::guard_relaxes). Every ErrorGuard is made from this.
GuardConfig GuardFor(const PolicyConfig& config);

// Known policy names (fixed_<block>_<budget> is a pattern, shown as such).
std::vector<std::string> PolicyNames();

// The known names for a --policy flag's help: the served ones, then those for comparison
// (PolicyTraits::for_comparison) marked as such.
std::string PolicyNamesHelp();

// The kind a policy name denotes (any fixed_... name is kFixedBlock; ParsePolicy checks its
// numbers). InvalidArgument naming the known policies for an unknown name.
absl::StatusOr<PolicyKind> ParsePolicyKind(absl::string_view name);

// Parses a policy name and budget into a config. `fixed_32_0.05` sets block 32 and budget 0.05
// (the budget argument is then ignored). InvalidArgument naming the known policies for an
// unknown name, and for a budget outside (0, 1].
absl::StatusOr<PolicyConfig> ParsePolicy(const std::string& name, double budget);

// Expands policy names x budgets for measuring commands: `full` and fixed_<block>_<budget> once,
// every other policy once per budget. Errors as ParsePolicy.
absl::StatusOr<std::vector<PolicyConfig>> ExpandPolicies(const std::vector<std::string>& names,
                                                         const std::vector<double>& budgets);

// Each config once per selector where its kind selects on the device (device_selects), once
// (as given) where it does not; in the order of `selectors`.
std::vector<PolicyConfig> ExpandSelectors(const std::vector<PolicyConfig>& configs,
                                          const std::vector<Selector>& selectors);

// `full`, `fixed_32_0.05`, or `<name>@<budget>` (e.g. `quest@0.05`): how results name a config;
// `+guard` appended when the error guard is on for it (`fluxion@0.05+guard`), `+device` when it
// selects from compact keys (DeviceSelects).
std::string PolicyLabel(const PolicyConfig& config);

// One request's Quest block scores for one layer, computed elsewhere (the hybrid step's device
// keeps every page's bounds: decode/step/resident_window.h, ScoreBlocks): for KV head h,
// data[h * head_stride + b] is block b's score at `block_tokens` tokens per block, for blocks
// [0, head_stride), head_stride = ceil(context / block_tokens).
struct ScoredBlocks {
  const float* data = nullptr;  // null: none
  int64_t head_stride = 0;
  int64_t block_tokens = 0;
  // The best blocks, ranked where the scores are (ResidentWindow::RankBlocks): for KV head h,
  // top[h * range.want + j], j < range.want, the block numbers in [range.first, range.end) of
  // the range.want largest scores, ascending (ties: lower numbers; NaN lowest), i.e. exactly what
  // kernels::cpu::TopKIndices over those scores picks. Null: not ranked. A ranked row's `data`
  // may be null: its scores need not cross to the host.
  const int32_t* top = nullptr;
  struct Range {
    int64_t first = 0, end = 0, want = 0;
  } range{};
  // The device selection's picks (ResidentWindow::SelectRows): KV head h's pick_count[h]
  // ascending positions at picks + pick_offset[h]. Null: none made there.
  const int32_t* picks = nullptr;
  const int64_t* pick_offset = nullptr;
  const int32_t* pick_count = nullptr;
};

// The blocks a policy that takes a fixed number of top-ranked blocks (quest, fixed_*) ranks at a
// context of `context` tokens: blocks [first, end) of RankedBlockTokens() tokens (those that
// reach the middle region) and how many it takes (want; 0 for every other policy, and when the
// budget leaves no whole block). budget_scale as SelectionInput's.
ScoredBlocks::Range TopBlocksRange(const PolicyConfig& config, int64_t context,
                                   int64_t page_tokens, double budget_scale = 1.0);

// What a policy sees at one decode step for one (layer, KV head).
struct SelectionInput {
  const PagedKv* kv = nullptr;
  int layer = 0;
  int kv_head = 0;
  const float* q = nullptr;  // [group][head_dim], post-RoPE, unscaled
  int64_t group = 1;
  float scale = 0.0f;
  int64_t context = 0;  // tokens stored for this layer, the current one included
  // This head's block scores when computed elsewhere: [ceil(context / block_score_tokens)], or
  // null. A policy that ranks page bounds at that block size reads them instead of scanning the
  // bounds; any other ignores them.
  const float* block_scores = nullptr;
  int64_t block_score_tokens = 0;
  // This head's best blocks when ranked elsewhere (ScoredBlocks::top): `top_range.want` block
  // numbers, ascending; null when not ranked. A policy uses them only when their range is the one
  // it would rank (TopBlocksRange at this step's budget_scale).
  const int32_t* top_blocks = nullptr;
  ScoredBlocks::Range top_range{};
  // The share of the middle-region budget (what remains after sinks and the window) this step
  // may spend, in (0, 1]: below 1 when the hybrid step degrades itself because the CPU would
  // stall the GPU (decode/step/stall_guard.h). Every policy that reads the middle applies it.
  double budget_scale = 1.0;
  // The online error guard's correction of this head's middle budget (error_guard.h), in units
  // of the uniform middle budget (after budget_scale): the head attends its policy's budget plus
  // floor(budget_shift x uniform) middle rows, within [0, middle]. A positive shift also vetoes
  // LFPS's bypass (the guard measured the head's error). Policies that are not guardable ignore it.
  double budget_shift = 0.0;
  // This head's middle rows picked from compact keys where they live (the hybrid step's device,
  // SparsePolicy::DevicePick): device_pick_count ascending positions; null when not picked there
  // (a policy that selects from compact keys then computes the same picks itself).
  const int32_t* device_picks = nullptr;
  int64_t device_pick_count = 0;
};

struct SelectionStats {
  int64_t rows_attended = 0;  // K/V rows the attention kernel reads
  int64_t k_rows_scored = 0;  // extra K rows read only to score (exact top-k)
  int64_t metadata_bytes = 0; // page metadata read on the CPU to score (Quest's fp32 bounds)
  int64_t blocks_scored_elsewhere = 0;  // blocks whose scores came in SelectionInput
  int64_t selections_ranked_elsewhere = 0;  // head-steps whose picks came in it (top_blocks)
  int64_t selections = 0;     // (step, KV head) selections a history policy made
  int64_t bypassed = 0;       // of those, how many bypassed to sinks + window (LFPS)
  int64_t streaming = 0;      // of those, how many had no middle budget (Fluxion's streaming heads)
  int64_t context = 0;        // tokens available
  // A history policy's head-steps that rescored candidates (LFPS's table candidates, Fluxion's
  // added too; not its exact refreshes): how many rows they rescored and the contexts they saw.
  // Their ratio is the candidate volume a decision profile records (decision_profile.h).
  int64_t candidate_steps = 0, candidate_rows = 0, candidate_context = 0;
  // Of candidate_steps, those whose table picks were made a step ahead (PrepareNextStep).
  int64_t candidate_steps_prepared = 0;
  // Of `selections`, the ones that read the middle region, by (block tokens, decided budget in
  // units of kBudgetUnit of the context, sinks and window included): what a decision profile
  // records (decision_profile.h). Block 1: token-level selection (LFPS).
  std::map<std::pair<int64_t, int64_t>, int64_t> retrieval;

  void Add(const SelectionStats& o) {
    rows_attended += o.rows_attended;
    k_rows_scored += o.k_rows_scored;
    metadata_bytes += o.metadata_bytes;
    blocks_scored_elsewhere += o.blocks_scored_elsewhere;
    selections_ranked_elsewhere += o.selections_ranked_elsewhere;
    selections += o.selections;
    bypassed += o.bypassed;
    streaming += o.streaming;
    context += o.context;
    candidate_steps += o.candidate_steps;
    candidate_rows += o.candidate_rows;
    candidate_context += o.candidate_context;
    candidate_steps_prepared += o.candidate_steps_prepared;
    for (const auto& [key, n] : o.retrieval) retrieval[key] += n;
  }
};

class SparsePolicy {
 public:
  virtual ~SparsePolicy() = default;

  // Called once per (layer, KV head) after the prompt's K/V are in `kv`, with that head's part of
  // the prefill's sparse state (model/sparse_state.h; null when none was captured) for policies
  // that start from the prefill (LFPS, Fluxion).
  virtual absl::Status Prepare(const PagedKv& kv, int layer, int kv_head,
                               const model::HeadSparseState* state) {
    return absl::OkStatus();
  }

  // Appends disjoint spans in token order covering the rows to attend, and adds to *stats.
  // `spans` may already hold other heads' spans (a step's plan is one list): append only.
  // A policy decides; it never attends: the step executor attends exactly these spans.
  virtual void Select(const SelectionInput& in, std::vector<kernels::PageSpan>* spans,
                      SelectionStats* stats) = 0;

  // After the step attended `spans` (what Select returned): lets history-based policies learn
  // from the step. Default: nothing.
  virtual void Observe(const SelectionInput& in, const std::vector<kernels::PageSpan>& spans) {}

  // After Observe, with what the next step of the same (layer, KV head) is expected to see
  // (`next.q` null: the query is not known yet): a policy may do now the part of that step's
  // selection that does not depend on the query (LFPS's table picks), so that the step's
  // critical path is shorter when the caller runs this off it. Select must select exactly what
  // it would have without the call, whatever input it then gets. Default: nothing.
  virtual void PrepareNextStep(const SelectionInput& next) {}

  // For the step just selected: an estimate of attention over the rows NOT attended, as a
  // partial state (out [group][head_dim], natural-base lse [group]) to merge into the output.
  // Returns false (the default) when the policy adds none.
  virtual bool ApproximateRest(const SelectionInput& in, float* out, float* lse) { return false; }

  // The head's share of the middle budget in units of the uniform one (1: a uniform policy's;
  // Fluxion: its allocation): what the error guard starts each head's weight at. Called after
  // every head is prepared.
  virtual double MiddleWeight(int layer, int kv_head) { return 1.0; }

  // For a policy that selects from compact keys (DeviceSelects): the middle region of the step of
  // `in` (q unused), how many of its rows it picks and among which, so the hybrid step's device
  // can pick them before Select runs (and hand them over in SelectionInput::device_picks). What
  // Select picks whenever it reads the middle: a function of the input and what the policy
  // decided before the step (LFPS may make its table candidates here, which Select then uses).
  // nullopt (the default): the policy selects itself.
  virtual std::optional<DeviceAsk> DevicePick(const SelectionInput& in) { return std::nullopt; }
};

std::unique_ptr<SparsePolicy> MakePolicy(const PolicyConfig& config);

// For a policy that ranks page bounds (PolicyTraits::ranks_page_bounds): the block size its
// scores are computed at over pages of `page_tokens`, and how many such blocks its uniform budget
// holds at `context` tokens (0: sinks + window cover the budget, nothing is scored).
int64_t RankedBlockTokens(const PolicyConfig& config, int64_t page_tokens);
int64_t RankedBlocksWanted(const PolicyConfig& config, int64_t context, int64_t page_tokens);

// Appends spans covering tokens [begin, end) of (layer, kv_head), split at page boundaries.
void AppendTokenRange(const PagedKv& kv, int layer, int kv_head, int64_t begin, int64_t end,
                      std::vector<kernels::PageSpan>* spans);

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_POLICY_H_
