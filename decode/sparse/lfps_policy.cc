#include "decode/sparse/lfps_policy.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <optional>

#include "absl/numeric/bits.h"
#include "decode/sparse/policy_util.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/cpu/selection.h"
#include "kernels/cpu/topk.h"

namespace fluxion::decode::sparse {

using kernels::PageSpan;

namespace {

// Expansion offsets around each predicted position [SEED]: the asymmetric +2 absorbs the one
// token a slash pattern moves per decode step.
constexpr int kExpand[] = {-1, 0, 1, 2};

}  // namespace

LfpsPolicy::LfpsPolicy(const PolicyConfig& config, const LfpsParams& params, bool paper_bypass)
    : config_(config), params_(params), paper_bypass_(paper_bypass) {
  // As published: bypass at rho >= 0.85 [SEED]. Ours keeps LfpsParams' calibrated 0.95.
  if (paper_bypass_) params_.bypass_rho = kPaperBypassRho;
  if (config.decision_profile != nullptr) {
    absl::StatusOr<PolicyDecisions> d = config.decision_profile->For(config);
    CHECK(d.ok()) << "PolicyConfig::decision_profile without an entry for the policy: "
                  << d.status();
    replay_ = *std::move(d);
    profile_ = config.decision_profile;
  }
}

const HeadReplay& LfpsPolicy::Replay(int layer, int kv_head) {
  HeadState& s = State(layer, kv_head);
  if (!s.replay_drawn) {
    s.replay = profile_->DrawHead(replay_, layer, kv_head);
    s.replay_drawn = true;
  }
  return s.replay;
}

void LfpsPolicy::HeadState::NoteMiddleShare(double share) {
  recent_shares[recent_next] = share;
  recent_next = (recent_next + 1) % kShareMemory;
  recent_count = std::min(recent_count + 1, kShareMemory);
}

double LfpsPolicy::HeadState::MiddleShare() const {
  if (recent_count == 0) return 1.0;
  return *std::max_element(recent_shares.begin(), recent_shares.begin() + recent_count);
}

LfpsPolicy::HeadState& LfpsPolicy::State(int layer, int kv_head) {
  auto it = states_.find({layer, kv_head});
  if (it == states_.end()) it = states_.emplace(std::make_pair(layer, kv_head), HeadState(params_)).first;
  return it->second;
}

void LfpsPolicy::GroupLogits(const PagedKv& kv, const std::vector<PageSpan>& spans,
                             const float* q, int64_t group, float scale, std::vector<float>* out) {
  int64_t rows = 0;
  for (const PageSpan& s : spans) rows += s.rows;
  out->resize(rows * group);
  kernels::cpu::GroupScores(kv.view(), spans.data(), spans.size(), q, group, out->data());
  for (float& x : *out) x *= scale;
}

int64_t LfpsPolicy::MiddleBudget(int layer, int kv_head, const Regions& r, int64_t context) {
  return r.middle_rows_budget;
}

double LfpsPolicy::MiddleWeight(int layer, int kv_head) {
  return replaying() ? Replay(layer, kv_head).weight : 1.0;
}

void LfpsPolicy::FoldGlobal(const PagedKv& kv, int layer, int kv_head, int64_t sink_end,
                            int64_t end, HeadState* s) {
  const int64_t d = kv.shape().head_dim, pt = kv.shape().page_tokens;
  if (s->key_sum.empty()) {
    s->key_sum.assign(d, 0.0);
    s->key_outer.assign(d * d, 0.0);
    s->value_sum.assign(d, 0.0);
    s->folded_end = sink_end;
  }
  const auto& pages = kv.pages(layer, kv_head);
  const kernels::PagedKvView view = kv.view();
  const int64_t first = std::max(s->folded_end, sink_end);
  if (end <= first) return;
  // Keys leaving the window one per step, or the whole prompt's middle at the first step: widen
  // them to fp32 and fold them in one syrk (O(n d^2) flops at matrix speed).
  // A step folds the one key that left the window: in the head's scratch, no allocation. The
  // first step folds the whole prompt's middle (64 MiB at 128K, head_dim 128): a buffer of its
  // own, not kept.
  constexpr int64_t kKeptKeys = 64;
  std::vector<float> whole_prompt;
  std::vector<float>& keys = end - first <= kKeptKeys ? ScratchOf(layer, kv_head).fold_keys : whole_prompt;
  keys.resize((end - first) * d);
  for (int64_t t = first; t < end; ++t) {
    const bf16* kr = view.keys(pages[t / pt]) + (t % pt) * d;
    const bf16* vr = view.values(pages[t / pt]) + (t % pt) * d;
    for (int64_t i = 0; i < d; ++i) {
      keys[(t - first) * d + i] = Bf16ToFloat(kr[i]);
      s->value_sum[i] += Bf16ToFloat(vr[i]);
    }
  }
  kernels::cpu::AccumulateMoments(keys.data(), end - first, d, s->key_sum.data(),
                                  s->key_outer.data());
  s->count += end - first;
  s->folded_end = std::max(s->folded_end, end);
}

absl::Status LfpsPolicy::Prepare(const PagedKv& kv, int layer, int kv_head,
                                 const model::HeadSparseState* state) {
  ScratchOf(layer, kv_head);  // every head's scratch exists before the first (parallel) step
  HeadState& s = State(layer, kv_head);
  if (state == nullptr) return absl::OkStatus();  // no capture: the first step refreshes exactly
  const int64_t n = std::min<int64_t>(state->vertical.size(), kv.length(layer));
  if (static_cast<int64_t>(state->slash.size()) < n) {
    return absl::InvalidArgumentError("sparse state tables are shorter than the prompt");
  }
  // The captured tables are already decayed to the end of the prompt (§1.3.3); sinks are
  // attended anyway and stay out of the vertical table. Tiny entries are dropped to keep the
  // tables sparse, as during decoding.
  for (int64_t j = config_.sink_tokens; j < n; ++j) {
    if (state->vertical[j] >= params_.min_weight) s.tables.AddVertical(j, state->vertical[j]);
  }
  for (int64_t dist = 0; dist < n; ++dist) {
    if (state->slash[dist] >= params_.min_weight) s.tables.AddSlash(dist, state->slash[dist]);
  }
  s.NoteMiddleShare(state->middle_share);
  s.need_fraction = state->need_fraction;
  s.steps_since_measured = 0;
  return absl::OkStatus();
}

Regions LfpsPolicy::StepRegions(const SelectionInput& in) {
  Regions r = SplitStep(config_, in);
  const int64_t uniform_rows = r.middle_rows_budget;
  if (replaying()) {
    // The profile's weight on the uniform middle budget, as Fluxion's MiddleBudget applies its
    // own (a weight of 1 is LFPS's budget).
    const double w = Replay(in.layer, in.kv_head).weight;
    r.middle_rows_budget = std::clamp<int64_t>(std::llround(w * r.middle_rows_budget), 0,
                                               r.local_begin - r.sink_end);
  } else {
    r.middle_rows_budget = MiddleBudget(in.layer, in.kv_head, r, in.context);
  }
  if (in.budget_shift != 0.0) {
    // The error guard's correction, in uniform middle budgets (error_guard.h), rounded down: the
    // shifts sum to 0 over the request's heads, and many small positive shifts rounded to
    // nearest over-spent the budget (+1.2% at 0.2 of 600 tokens); rounded down the request never
    // reads more than its policy would, at most a row per head less.
    r.middle_rows_budget = std::clamp<int64_t>(
        r.middle_rows_budget +
            static_cast<int64_t>(std::floor(in.budget_shift * static_cast<double>(uniform_rows))),
        0, r.local_begin - r.sink_end);
  }
  return r;
}

bool LfpsPolicy::RefreshDue(const HeadState& s) const {
  return s.steps_since_refresh >= params_.refresh_every ||
         s.tables.vertical().moments().count == 0;
}

void LfpsPolicy::MarkTablePicks(HeadState& s, Scratch& x, const Regions& r, int64_t context,
                                int64_t k, CandidateMarks* marks) {
  const int64_t t = context - 1;
  // Each table has both clamps on its own: at least 2k entries, at most max(2k, candidate_cap
  // x t). ALGORITHMS.md §1.3.4 clamps |V| + |D| together (half of each per table), which halves
  // the rows rescored at 8B shapes but measured worse on the trained model: 4K, passage /
  // aggregate / niah_multivalue x 12 seeds, budgets 0.02 and 0.05, 72 paired samples: 7 lost,
  // 1 gained against these clamps (niah_multivalue at 0.02: 5 of 12 lost;
  // bench/results/eval-lfps-clamp-compare-devbox-20261202.txt). The quality tables
  // (docs/SPARSE.md) are these clamps'.
  const int64_t table_min = 2 * k;
  const int64_t table_cap =
      std::max<int64_t>(table_min, static_cast<int64_t>(params_.candidate_cap * context));
  std::vector<int64_t>& vertical = x.vertical;
  std::vector<int64_t>& slash = x.slash;
  vertical.clear();
  slash.clear();
  // Only entries that land in the middle region compete (lfps_tables.h says why); an entry
  // just outside it still reaches in through the expansion offsets, so the ranges are widened
  // by them.
  // The two tables select concurrently (idle threads of the step take one: RunAsTasks).
  kernels::cpu::RunAsTasks(2, [&](int64_t table) {
    if (table == 0) {
      s.tables.vertical().SelectAbove(params_.threshold_a, table_min, table_cap,
                                      r.sink_end - 2, r.local_begin + 2, &vertical);
    } else {
      s.tables.slash().SelectAbove(params_.threshold_a, table_min, table_cap,
                                   t - r.local_begin, t - r.sink_end + 4, &slash);
    }
  });
  // The expanded picks go straight into a bitmap over the middle (a run of 4 bits each, one
  // or two word ORs), then the bitmap is read out in order: the candidates sorted and distinct
  // without a vector of 4 entries per pick (pushing those was the largest serial part of a
  // head-step on the H200 host: bench/results/perf-lfps-8b-128k-h200-20261204.txt).
  for (int64_t p : vertical) marks->MarkRun(p + kExpand[0], std::size(kExpand));
  for (int64_t dist : slash) marks->MarkRun(t - dist + kExpand[0], std::size(kExpand));
}

void LfpsPolicy::PrepareNextStep(const SelectionInput& next) {
  HeadState& s = State(next.layer, next.kv_head);
  s.prepared.context = -1;
  // Nothing to make for a step that refreshes exactly, or that will likely bypass (the head
  // bypassed this step; a wrong guess costs a table pass off the critical path, or one on it).
  // Under the device selector every head is prepared: the device is asked for the picks before
  // the step knows which heads bypass (DevicePick), and an unprepared head would make its table
  // pass then, on the critical path.
  if (RefreshDue(s) || (s.bypassed && !DeviceSelects(config_))) return;
  if (replaying() && profile_->DrawBypass(replay_, next.layer, next.kv_head, next.context)) {
    return;
  }
  const Regions r = StepRegions(next);
  if (r.middle_rows_budget <= 0 || r.local_begin <= r.sink_end) return;
  CandidateMarks marks(r.sink_end, r.local_begin, &s.prepared.bits);
  MarkTablePicks(s, ScratchOf(next.layer, next.kv_head), r, next.context, r.middle_rows_budget,
                 &marks);
  s.prepared.context = next.context;
  s.prepared.k = r.middle_rows_budget;
  s.prepared.sink_end = r.sink_end;
  s.prepared.local_begin = r.local_begin;
}

void LfpsPolicy::Select(const SelectionInput& in, std::vector<PageSpan>* spans,
                        SelectionStats* stats) {
  HeadState& s = State(in.layer, in.kv_head);
  Scratch& x = ScratchOf(in.layer, in.kv_head);
  const Regions r = StepRegions(in);
  s.bypassed = false;
  x.logits_valid = false;  // until this step's logits of what it attends are all known
  std::vector<PageSpan>& middle = x.middle;
  middle.clear();
  ++stats->selections;
  if (r.middle_rows_budget <= 0 || r.local_begin <= r.sink_end) {
    ++stats->streaming;
    AssembleSpans(in, r, middle, spans, stats);
    return;
  }
  FoldGlobal(*in.kv, in.layer, in.kv_head, r.sink_end, r.local_begin, &s);
  if (Bypasses(in, s, MeasureStreaming(in, r, s, x))) {
    x.picked_logits.clear();
    x.logits_valid = true;
    s.bypassed = true;
    ++s.steps_since_measured;
    ++stats->bypassed;
    AssembleSpans(in, r, middle, spans, stats);
    return;
  }
  if (DeviceSelects(config_)) {
    PickOnDevice(in, r, s, x, &middle, stats);
  } else {
    x.picked.clear();
    if (RefreshDue(s)) {
      PickExactly(in, r, s, x, stats);
    } else {
      PickFromTables(in, r, s, x, stats);
    }
    // In order already unless the exact refresh's top-k picked them (a sort of sorted input
    // still costs n log n on the head-step's serial path).
    if (!std::is_sorted(x.picked.begin(), x.picked.end())) {
      std::sort(x.picked.begin(), x.picked.end());
    }
    AppendPositions(*in.kv, in.layer, in.kv_head, x.picked, &middle);
  }
  AssembleSpans(in, r, middle, spans, stats);
  // The decision, for decision profiles: the budget the head-step was given (not what its
  // candidates let it spend), sinks and window included.
  const int64_t decided = r.middle_rows_budget + r.sink_end + (in.context - r.local_begin);
  const int64_t units = std::llround(static_cast<double>(decided) / (kBudgetUnit * in.context));
  ++stats->retrieval[{RetrievalBlock(in.layer, in.kv_head), std::max<int64_t>(units, 1)}];
}

bool LfpsPolicy::MeasureStreaming(const SelectionInput& in, const Regions& r, HeadState& s,
                                  Scratch& x) {
  const int64_t d = in.kv->shape().head_dim;
  // Head sparsity (§1.3.8): exact mass of sinks + window against a log-normal estimate of the
  // global region's, for every query head of the group.
  x.spans.clear();
  AppendTokenRange(*in.kv, in.layer, in.kv_head, 0, r.sink_end, &x.spans);
  AppendTokenRange(*in.kv, in.layer, in.kv_head, r.local_begin, in.context, &x.spans);
  bool all_streaming = s.count > 0;
  s.global_log_mass.assign(in.group, -INFINITY);
  GroupLogits(*in.kv, x.spans, in.q, in.group, in.scale, &x.edge_logits);
  x.sink_rows = r.sink_end;
  const int64_t exact_rows = static_cast<int64_t>(x.edge_logits.size()) / in.group;
  for (int64_t g = 0; g < in.group; ++g) {
    const float* q = in.q + g * d;
    double m = -INFINITY;
    for (int64_t j = 0; j < exact_rows; ++j) {
      m = std::max<double>(m, x.edge_logits[j * in.group + g]);
    }
    double z_exact = 0;
    for (int64_t j = 0; j < exact_rows; ++j) {
      z_exact += std::exp(x.edge_logits[j * in.group + g] - m);
    }
    if (s.count == 0) continue;
    const double n = static_cast<double>(s.count);
    // var = q^T (E[k k^T] - E[k] E[k]^T) q = (q^T K q) / n - mu^2 with K the summed outer
    // products. K q is accumulated row by row (y += q_i K[i, :]), which vectorises without
    // reassociation; the former element-wise form divided and chained d^2 scalar adds per query
    // head and was half of LFPS's step at 4K (perf).
    double mu = 0;
    for (int64_t i = 0; i < d; ++i) mu += q[i] * s.key_sum[i];
    mu /= n;
    x.kq.assign(d, 0.0);
    double* y = x.kq.data();
    for (int64_t i = 0; i < d; ++i) {
      const double qi = q[i];
      const double* row = s.key_outer.data() + i * d;
      for (int64_t j = 0; j < d; ++j) y[j] += qi * row[j];
    }
    double quad = 0;
    for (int64_t j = 0; j < d; ++j) quad += q[j] * y[j];
    double var = quad / n - mu * mu;
    mu *= in.scale;
    var = std::max(0.0, var) * in.scale * in.scale;
    s.global_log_mass[g] = std::log(n) + mu + var / 2;
    const double z_global = std::exp(s.global_log_mass[g] - m);
    const double rho = z_exact / (z_exact + z_global);
    if (rho < params_.bypass_rho) all_streaming = false;
  }
  return all_streaming;
}

bool LfpsPolicy::Bypasses(const SelectionInput& in, const HeadState& s, bool all_streaming) {
  // Re-measure every refresh period: a head may turn from streaming to retrieval.
  const bool measured_recently = s.steps_since_measured < params_.refresh_every;
  // Under a profile the estimate above is still computed (it is the policy's work every
  // retrieval head-step), but the profile decides.
  if (in.budget_shift > 0.0) return false;  // the guard measured its error above tolerance
  if (replaying()) return profile_->DrawBypass(replay_, in.layer, in.kv_head, in.context);
  return all_streaming && measured_recently && s.MiddleShare() <= 1.0 - params_.bypass_rho;
}

void LfpsPolicy::PickExactly(const SelectionInput& in, const Regions& r, HeadState& s, Scratch& x,
                             SelectionStats* stats) {
  const int64_t n_middle = r.local_begin - r.sink_end;
  // Safety valve: an exact top-k over the whole middle region.
  x.spans.clear();
  AppendTokenRange(*in.kv, in.layer, in.kv_head, r.sink_end, r.local_begin, &x.spans);
  x.scores.resize(n_middle);
  kernels::cpu::MaxGroupScoresInTasks(in.kv->view(), x.spans.data(), x.spans.size(), in.q,
                                      in.group, x.scores.data());
  stats->k_rows_scored += n_middle;
  kernels::cpu::TopKIndicesInTasks(x.scores.data(), n_middle, r.middle_rows_budget, &x.picked);
  for (int32_t& i : x.picked) i += static_cast<int32_t>(r.sink_end);
  s.steps_since_refresh = 0;
}

void LfpsPolicy::PickFromTables(const SelectionInput& in, const Regions& r, HeadState& s,
                                Scratch& x, SelectionStats* stats) {
  // Candidates from the history tables, expanded, restricted to the middle region: made a
  // step ahead when they were for these regions and this budget (PrepareNextStep), else now.
  const int64_t k = r.middle_rows_budget;
  std::vector<int32_t>& candidates = x.candidates;
  HeadState::PreparedPicks& ahead = s.prepared;
  std::optional<CandidateMarks> marks;
  if (ahead.context == in.context && ahead.k == k && ahead.sink_end == r.sink_end &&
      ahead.local_begin == r.local_begin) {
    x.candidate_bits.swap(ahead.bits);
    marks.emplace(CandidateMarks::Marked(r.sink_end, r.local_begin, &x.candidate_bits));
    ++stats->candidate_steps_prepared;
  } else {
    marks.emplace(r.sink_end, r.local_begin, &x.candidate_bits);
    MarkTablePicks(s, x, r, in.context, k, &*marks);
  }
  ahead.context = -1;
  // Fluxion's added blocks join them in the bitmap.
  AddCandidates(in, r, k, &*marks, stats);
  marks->ReadOut(&candidates);
  if (replaying() && replay_.rescored_share > 0) {
    // The recorded model's candidate volume (PolicyDecisions::rescored_share), never below
    // the budget: the tables were selected and expanded as always.
    ThinEvenly(std::max<int64_t>(k, std::llround(replay_.rescored_share * in.context)),
               std::size(kExpand), &candidates);
  }
  ++stats->candidate_steps;
  stats->candidate_rows += static_cast<int64_t>(candidates.size());
  stats->candidate_context += in.context;
  if (static_cast<int64_t>(candidates.size()) <= k) {
    x.picked = candidates;
  } else {
    // Every query head's logits in one walk, in tasks that build their own spans and take
    // the max over the group (its value is MaxGroupScores', bit for bit: one kernel): the
    // picked rows' logits are kept for Observe, which would otherwise read those K rows again.
    const int64_t n = static_cast<int64_t>(candidates.size()), group = in.group;
    x.group_scores.resize(n * group);
    x.scores.resize(n);
    ScorePositionsInTasks(*in.kv, in.layer, in.kv_head, candidates, in.q, group,
                          x.group_scores.data(), x.scores.data());
    kernels::cpu::TopKIndicesInTasks(x.scores.data(), n, k, &x.picked_local);
    // In candidate order (the candidates are sorted) through a bitmap over [0, n): O(k + n /
    // 64), where a sort of the k picks cost k log k on the serial path.
    CandidateMarks order(0, n, &x.picked_bits);
    for (int32_t i : x.picked_local) order.MarkRun(i, 1);
    order.ReadOut(&x.picked_local);
    x.picked_logits.resize(x.picked_local.size() * group);
    for (size_t j = 0; j < x.picked_local.size(); ++j) {
      const int32_t i = x.picked_local[j];
      x.picked.push_back(candidates[i]);
      for (int64_t g = 0; g < group; ++g) {
        x.picked_logits[j * group + g] = x.group_scores[i * group + g] * in.scale;
      }
    }
    x.logits_valid = true;
  }
  stats->k_rows_scored += static_cast<int64_t>(candidates.size());
  ++s.steps_since_refresh;
}

const std::vector<uint64_t>& LfpsPolicy::PreparedCandidates(const SelectionInput& in,
                                                             const Regions& r, HeadState& s) {
  HeadState::PreparedPicks& ahead = s.prepared;
  const int64_t k = r.middle_rows_budget;
  if (ahead.context != in.context || ahead.k != k || ahead.sink_end != r.sink_end ||
      ahead.local_begin != r.local_begin) {
    CandidateMarks marks(r.sink_end, r.local_begin, &ahead.bits);
    MarkTablePicks(s, ScratchOf(in.layer, in.kv_head), r, in.context, k, &marks);
    ahead.context = in.context;
    ahead.k = k;
    ahead.sink_end = r.sink_end;
    ahead.local_begin = r.local_begin;
  }
  return ahead.bits;
}

DeviceAsk LfpsPolicy::AskFor(const SelectionInput& in, const Regions& r, HeadState& s) {
  if (RefreshDue(s)) return DeviceAskOf(r);
  return DeviceAskOf(r, &PreparedCandidates(in, r, s));
}

std::optional<DeviceAsk> LfpsPolicy::DevicePick(const SelectionInput& in) {
  if (!DeviceSelects(config_)) return std::nullopt;
  const Regions r = StepRegions(in);
  if (r.middle_rows_budget <= 0 || r.local_begin <= r.sink_end) return DeviceAsk{};
  // Under a profile the bypass is drawn (Bypasses), unless the guard vetoes it: such a head-step
  // reads no middle row. Otherwise the bypass needs the step's query: the device picks anyway.
  if (replaying() && in.budget_shift <= 0.0 &&
      profile_->DrawBypass(replay_, in.layer, in.kv_head, in.context)) {
    return DeviceAsk{};
  }
  return AskFor(in, r, State(in.layer, in.kv_head));
}

void LfpsPolicy::PickOnDevice(const SelectionInput& in, const Regions& r, HeadState& s,
                              Scratch& x, std::vector<PageSpan>* middle, SelectionStats* stats) {
  const bool refresh = RefreshDue(s);
  const DeviceAsk ask = AskFor(in, r, s);
  if (ask.candidates != nullptr) {
    int64_t candidates = 0;
    for (uint64_t w : *ask.candidates) candidates += absl::popcount(w);
    ++stats->candidate_steps;
    stats->candidate_rows += candidates;
    stats->candidate_context += in.context;
  }
  x.compact.SelectMiddle(in, ask, middle, stats);
  s.prepared.context = -1;  // used
  if (refresh) {
    s.steps_since_refresh = 0;
  } else {
    ++s.steps_since_refresh;
  }
}

void LfpsPolicy::Observe(const SelectionInput& in, const std::vector<PageSpan>& spans) {
  HeadState& s = State(in.layer, in.kv_head);
  Scratch& x = ScratchOf(in.layer, in.kv_head);
  const int64_t pt = in.kv->shape().page_tokens;
  const int64_t t = in.context - 1;
  const Regions r = SplitContext(config_, in.context);
  const auto& pages = in.kv->pages(in.layer, in.kv_head);
  std::vector<int32_t>& positions = x.positions;
  positions.clear();
  // Spans come in position order (sinks, middle, window), so each page is searched for from the
  // previous span's page on: O(pages + spans) per step instead of O(pages x spans), which at 128K
  // (8192 pages of 16 tokens) was a visible part of the step.
  auto hint = pages.begin();
  for (const PageSpan& sp : spans) {
    auto it = std::find(hint, pages.end(), sp.page);
    if (it == pages.end()) it = std::find(pages.begin(), hint, sp.page);
    hint = it;
    const int64_t page_index = it - pages.begin();
    for (int32_t row = sp.first_row; row < sp.first_row + sp.rows; ++row) {
      positions.push_back(static_cast<int32_t>(page_index * pt + row));
    }
  }
  // Spans come in token order (sinks, the picks, the window): sorted already, as a rule.
  if (!std::is_sorted(positions.begin(), positions.end())) {
    std::sort(positions.begin(), positions.end());
  }
  s.tables.Step();
  if (positions.empty()) return;
  // The logits of what the step attended: from Select when it computed them all (sinks and
  // window, then the picked middle rows, in position order), else from the K rows.
  const size_t edge_rows = x.edge_logits.size() / in.group;
  const size_t picked_rows = x.picked_logits.size() / in.group;
  if (x.logits_valid && edge_rows + picked_rows == positions.size() &&
      x.sink_rows <= static_cast<int64_t>(edge_rows)) {
    const int64_t g = in.group;
    x.scores.clear();
    x.scores.insert(x.scores.end(), x.edge_logits.begin(), x.edge_logits.begin() + x.sink_rows * g);
    x.scores.insert(x.scores.end(), x.picked_logits.begin(), x.picked_logits.end());
    x.scores.insert(x.scores.end(), x.edge_logits.begin() + x.sink_rows * g, x.edge_logits.end());
  } else {
    x.spans.clear();
    AppendPositions(*in.kv, in.layer, in.kv_head, positions, &x.spans);
    GroupLogits(*in.kv, x.spans, in.q, in.group, in.scale, &x.scores);
  }
  // Per head: the softmax over the attended rows gives the middle region's share of the
  // attended mass (a lower bound on its share of the full mass: re-measured whenever the head is
  // not bypassed); the softmax over the attended rows minus the sinks gives the half-normalised
  // weights that feed the tables (§1.3.1: the sinks' forced, large mass carries no indexing
  // information). Both are maxed over the group (§1.3.7). Each query head is a task (its
  // exponentials were most of Observe at long contexts); the max over the group is taken after,
  // which is the same value whatever order the heads ran in.
  const int64_t group = in.group;
  const size_t n = positions.size();
  x.head_weights.resize(group * n);
  x.head_exps.resize(group * n);
  x.head_middle_share.assign(group, 0.0);
  kernels::cpu::RunAsTasks(group, [&](int64_t g) {
    auto score = [&](size_t j) { return x.scores[j * group + g]; };
    float m = -INFINITY, m_all = -INFINITY;
    for (size_t j = 0; j < n; ++j) {
      m_all = std::max(m_all, score(j));
      if (positions[j] >= config_.sink_tokens) m = std::max(m, score(j));
    }
    double z = 0, z_all = 0, z_middle = 0;
    // exp(s - m) = exp(s - m_all) exp(m_all - m): one exponential per row instead of three
    // (they were most of Observe at 8B shapes). While m_all - m stays far inside fp64's range no
    // row that carries weight underflows; otherwise each weight takes its own exponential.
    const bool one_exp = m_all - m < 600.0f;
    const double rescale = one_exp ? std::exp(static_cast<double>(m_all) - m) : 0.0;
    double* e = x.head_exps.data() + g * n;
    for (size_t j = 0; j < n; ++j) {
      e[j] = std::exp(score(j) - m_all);
      z_all += e[j];
      if (positions[j] >= r.sink_end && positions[j] < r.local_begin) z_middle += e[j];
      if (positions[j] >= config_.sink_tokens) {
        z += one_exp ? e[j] * rescale : std::exp(score(j) - m);
      }
    }
    x.head_middle_share[g] = z_middle / z_all;
    float* w = x.head_weights.data() + g * n;
    for (size_t j = 0; j < n; ++j) {
      if (positions[j] < config_.sink_tokens) {
        w[j] = 0.0f;
      } else {
        w[j] = static_cast<float>((one_exp ? e[j] * rescale : std::exp(score(j) - m)) / z);
      }
    }
  });
  std::vector<float>& best = x.best_weights;
  best.assign(n, 0.0f);
  double middle_share = 0;
  for (int64_t g = 0; g < group; ++g) {
    middle_share = std::max(middle_share, x.head_middle_share[g]);
    const float* w = x.head_weights.data() + g * n;
    for (size_t j = 0; j < n; ++j) best[j] = std::max(best[j], w[j]);
  }
  if (!s.bypassed) {
    s.NoteMiddleShare(middle_share);
    s.steps_since_measured = 0;
  }
  // The two tables take the same weights independently: one task each.
  kernels::cpu::RunAsTasks(2, [&](int64_t table) {
    for (size_t j = 0; j < n; ++j) {
      if (best[j] < params_.min_weight) continue;
      if (table == 0) {
        s.tables.AddVertical(positions[j], best[j]);
      } else {
        s.tables.AddSlash(t - positions[j], best[j]);
      }
    }
  });
}

bool LfpsPolicy::ApproximateRest(const SelectionInput& in, float* out, float* lse) {
  if (!paper_bypass_) return false;
  HeadState& s = State(in.layer, in.kv_head);
  if (!s.bypassed || s.count == 0) return false;
  // The published bypass: the global region as one pseudo-row holding its mean value vector and
  // its estimated total mass.
  const int64_t d = in.kv->shape().head_dim;
  for (int64_t g = 0; g < in.group; ++g) {
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<float>(s.value_sum[i] / s.count);
    lse[g] = static_cast<float>(s.global_log_mass[g]);
  }
  return true;
}

}  // namespace fluxion::decode::sparse
