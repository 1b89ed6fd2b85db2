#include "decode/sparse/policy.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "decode/sparse/device_selection.h"
#include "decode/sparse/fluxion_policy.h"
#include "decode/sparse/lfps_policy.h"
#include "decode/sparse/policy_util.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/cpu/selection.h"
#include "kernels/cpu/topk.h"

namespace fluxion::decode::sparse {

using kernels::PageSpan;

namespace {

class FullPolicy : public SparsePolicy {
 public:
  void Select(const SelectionInput& in, std::vector<PageSpan>* spans,
              SelectionStats* stats) override {
    AppendTokenRange(*in.kv, in.layer, in.kv_head, 0, in.context, spans);
    stats->rows_attended += in.context;
    stats->context += in.context;
  }
};

// Exact top-k tokens of the middle region by the largest scaled logit over the group's heads:
// the quality ceiling for token-level selection, paying a full K scan to score.
// Under Selector::kDevice the scores are the compact keys' (device_selection.h).
class ExactTopKPolicy : public SparsePolicy {
 public:
  explicit ExactTopKPolicy(const PolicyConfig& c) : config_(c) {}

  std::optional<DeviceAsk> DevicePick(const SelectionInput& in) override {
    if (!DeviceSelects(config_)) return std::nullopt;
    return DeviceAskOf(SplitStep(config_, in));
  }

  void Select(const SelectionInput& in, std::vector<PageSpan>* spans,
              SelectionStats* stats) override {
    const Regions r = SplitStep(config_, in);
    std::vector<PageSpan> middle;
    const int64_t n = r.local_begin - r.sink_end;
    if (DeviceSelects(config_)) {
      compact_.SelectMiddle(in, DeviceAskOf(r), &middle, stats);
    } else if (r.middle_rows_budget > 0 && n > 0) {
      scan_.clear();
      AppendTokenRange(*in.kv, in.layer, in.kv_head, r.sink_end, r.local_begin, &scan_);
      scores_.resize(n);
      kernels::cpu::MaxGroupScoresInTasks(in.kv->view(), scan_.data(), scan_.size(), in.q,
                                          in.group, scores_.data());
      stats->k_rows_scored += n;
      kernels::cpu::TopKIndicesInTasks(scores_.data(), n, r.middle_rows_budget, &picked_);
      std::sort(picked_.begin(), picked_.end());
      for (int32_t& i : picked_) i += static_cast<int32_t>(r.sink_end);
      AppendPositions(*in.kv, in.layer, in.kv_head, picked_, &middle);
    }
    AssembleSpans(in, r, middle, spans, stats);
  }

 private:
  PolicyConfig config_;
  std::vector<kernels::PageSpan> scan_;
  std::vector<float> scores_;
  std::vector<int32_t> picked_;
  CompactSelection compact_;
};

// Quest: score each block of the middle region by the upper bound of q.k over the block's keys,
// sum_d max(q_d * min_d, q_d * max_d) (max over the group's heads), attend the top blocks.
class QuestPolicy : public SparsePolicy {
 public:
  explicit QuestPolicy(const PolicyConfig& c) : config_(c) {}

  void Select(const SelectionInput& in, std::vector<PageSpan>* spans,
              SelectionStats* stats) override {
    const Regions r = SplitStep(config_, in);
    middle_.clear();
    const int64_t pt = in.kv->shape().page_tokens, d = in.kv->shape().head_dim;
    const int64_t block = RankedBlockTokens(config_, pt);
    const int64_t pages_per_block = block / pt;
    const ScoredBlocks::Range range = TopBlocksRange(config_, in.context, pt, in.budget_scale);
    const int64_t first_block = range.first, nblocks = range.end - range.first;
    const int64_t want = range.want;
    if (want > 0 && in.top_blocks != nullptr && in.top_range.first == range.first &&
        in.top_range.end == range.end && in.top_range.want == want) {
      // Ranked where the scores are (the device): the same picks, already in order.
      picked_.assign(in.top_blocks, in.top_blocks + want);
      for (int32_t& b : picked_) b -= static_cast<int32_t>(first_block);
      stats->blocks_scored_elsewhere += nblocks;
      ++stats->selections_ranked_elsewhere;
    } else if (want > 0) {
      const float* scores;
      if (in.block_scores != nullptr && in.block_score_tokens == block) {
        scores = in.block_scores + first_block;  // scored where the bounds are (the device)
        stats->blocks_scored_elsewhere += nblocks;
      } else {
        scores_.resize(nblocks);
        kernels::cpu::QuestBlockBounds(in.kv->key_min(in.layer, in.kv_head),
                                       in.kv->key_max(in.layer, in.kv_head), d, first_block,
                                       nblocks, pages_per_block, in.q, in.group, scores_.data());
        stats->metadata_bytes += nblocks * pages_per_block * 2 * d * int64_t{sizeof(float)};
        scores = scores_.data();
      }
      kernels::cpu::TopKIndices(scores, nblocks, want, &picked_);
      std::sort(picked_.begin(), picked_.end());
    } else {
      picked_.clear();
    }
    for (int32_t b : picked_) {
      // Blocks straddling the sinks or the window contribute only their middle part.
      const int64_t begin = std::max((first_block + b) * block, r.sink_end);
      const int64_t end = std::min((first_block + b + 1) * block, r.local_begin);
      if (begin < end) AppendTokenRange(*in.kv, in.layer, in.kv_head, begin, end, &middle_);
    }
    AssembleSpans(in, r, middle_, spans, stats);
  }

 private:
  PolicyConfig config_;
  std::vector<float> scores_;
  std::vector<int32_t> picked_;
  std::vector<PageSpan> middle_;
};

}  // namespace

namespace {

struct KindEntry {
  PolicyKind kind;
  PolicyTraits traits;
};

// One row per kind; PolicyNames(), ParsePolicyKind() and TraitsOf() all read this table.
constexpr KindEntry kKinds[] = {
    {PolicyKind::kFull, {"full", true, false, false, true, false, false, false, false, false}},
    {PolicyKind::kExactTopK,
     {"exact_topk", false, false, false, true, false, false, false, true, false}},
    {PolicyKind::kQuest, {"quest", false, false, false, true, true, false, false, false, true}},
    {PolicyKind::kLfps, {"lfps", false, true, false, true, false, true, false, true, false}},
    {PolicyKind::kLfpsPaper,
     {"lfps_paper", false, true, false, true, false, false, false, true, true}},
    {PolicyKind::kFluxion, {"fluxion", false, true, true, false, true, true, true, true, false}},
    {PolicyKind::kFluxionRules,
     {"fluxion_rules", false, true, false, false, true, false, false, true, true}},
    {PolicyKind::kFixedBlock,
     {"fixed_<block>_<budget>", true, false, false, true, true, false, false, false, true}},
};

constexpr absl::string_view kFixedPrefix = "fixed_";

}  // namespace

const PolicyTraits& TraitsOf(PolicyKind kind) {
  for (const KindEntry& e : kKinds) {
    if (e.kind == kind) return e.traits;
  }
  LOG(FATAL) << "PolicyKind " << static_cast<int>(kind) << " has no row in kKinds";
}

bool ReadsPageScores(const PolicyConfig& config) {
  if (DeviceSelects(config)) return false;  // compact keys replace the page bounds' scores
  return TraitsOf(config.kind).ranks_page_bounds;
}

bool DeviceSelects(const PolicyConfig& config) {
  return config.selector == Selector::kDevice && TraitsOf(config.kind).device_selects;
}

absl::StatusOr<Selector> ParseSelector(absl::string_view name) {
  if (name == "host") return Selector::kHost;
  if (name == "device") return Selector::kDevice;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown selector '", name, "' (known: host, device)"));
}

const char* SelectorName(Selector selector) {
  return selector == Selector::kDevice ? "device" : "host";
}

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names;
  for (const KindEntry& e : kKinds) names.push_back(e.traits.name);
  return names;
}

std::string PolicyNamesHelp() {
  std::vector<absl::string_view> served, comparison;
  for (const KindEntry& e : kKinds) {
    (e.traits.for_comparison ? comparison : served).push_back(e.traits.name);
  }
  return absl::StrCat(absl::StrJoin(served, ", "), "; for comparison, not for serving: ",
                      absl::StrJoin(comparison, ", "));
}

absl::StatusOr<PolicyKind> ParsePolicyKind(absl::string_view name) {
  if (absl::StartsWith(name, kFixedPrefix)) return PolicyKind::kFixedBlock;
  for (const KindEntry& e : kKinds) {
    if (e.kind != PolicyKind::kFixedBlock && name == e.traits.name) return e.kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy '", name, "'; known: ", PolicyNamesHelp()));
}

absl::StatusOr<PolicyConfig> ParsePolicy(const std::string& name, double budget) {
  PolicyConfig c;
  FLUXION_ASSIGN_OR_RETURN(c.kind, ParsePolicyKind(name));
  c.name = name;
  c.budget = budget;
  if (c.kind == PolicyKind::kFixedBlock) {
    std::vector<std::string> parts = absl::StrSplit(name, '_');
    double b = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[1], &c.block_tokens) ||
        !absl::SimpleAtod(parts[2], &b) || c.block_tokens <= 0 || c.block_tokens % 16 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy '", name, "' should look like fixed_<block>_<budget>, e.g. fixed_32_0.05, "
                            "with a block that is a multiple of 16 tokens"));
    }
    c.budget = b;
  } else if (c.kind == PolicyKind::kFull) {
    c.budget = 1.0;
  }
  if (!(c.budget > 0.0 && c.budget <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget must be in (0, 1], got ", c.budget, " for policy ", name));
  }
  return c;
}

absl::StatusOr<std::vector<PolicyConfig>> ExpandPolicies(const std::vector<std::string>& names,
                                                         const std::vector<double>& budgets) {
  std::vector<PolicyConfig> configs;
  for (const std::string& name : names) {
    FLUXION_ASSIGN_OR_RETURN(PolicyKind kind, ParsePolicyKind(name));
    for (double b : TraitsOf(kind).budget_from_name ? std::vector<double>{1.0} : budgets) {
      FLUXION_ASSIGN_OR_RETURN(PolicyConfig c, ParsePolicy(name, b));
      configs.push_back(std::move(c));
    }
  }
  return configs;
}

bool GuardActive(const PolicyConfig& config) {
  return config.guard.enabled && TraitsOf(config.kind).guardable &&
         config.output_projection != nullptr;
}

GuardConfig GuardFor(const PolicyConfig& config) {
  GuardConfig guard = config.guard;
  if (!TraitsOf(config.kind).guard_relaxes) guard.relax_ratio = 0;  // never below the line
  return guard;
}

std::string PolicyLabel(const PolicyConfig& config) {
  if (TraitsOf(config.kind).budget_from_name) return config.name;
  return absl::StrCat(config.name, "@", config.budget,
                      config.guard.enabled && TraitsOf(config.kind).guardable ? "+guard" : "",
                      DeviceSelects(config) ? "+device" : "");
}

std::vector<PolicyConfig> ExpandSelectors(const std::vector<PolicyConfig>& configs,
                                          const std::vector<Selector>& selectors) {
  std::vector<PolicyConfig> out;
  for (const PolicyConfig& c : configs) {
    bool any = false;
    for (Selector s : selectors) {
      if (s == Selector::kDevice && !TraitsOf(c.kind).device_selects) continue;
      out.push_back(c);
      out.back().selector = s;
      any = true;
    }
    if (!any) out.push_back(c);
  }
  return out;
}

std::unique_ptr<SparsePolicy> MakePolicy(const PolicyConfig& config) {
  switch (config.kind) {
    case PolicyKind::kFull:
      return std::make_unique<FullPolicy>();
    case PolicyKind::kExactTopK:
      return std::make_unique<ExactTopKPolicy>(config);
    case PolicyKind::kQuest:
    case PolicyKind::kFixedBlock:
      return std::make_unique<QuestPolicy>(config);
    case PolicyKind::kLfps:
    case PolicyKind::kLfpsPaper:
      return std::make_unique<LfpsPolicy>(config, LfpsParams{},
                                          config.kind == PolicyKind::kLfpsPaper);
    case PolicyKind::kFluxion:
      return std::make_unique<FluxionPolicy>(config, config.fluxion_predictor);
    case PolicyKind::kFluxionRules:
      return std::make_unique<FluxionPolicy>(config, nullptr);
  }
  LOG(FATAL) << "PolicyKind " << static_cast<int>(config.kind) << " has no factory";
}

int64_t RankedBlockTokens(const PolicyConfig& config, int64_t page_tokens) {
  // Fluxion scores pages and ranks its per-head blocks by their best page (fluxion_policy.h).
  if (config.kind == PolicyKind::kFluxion || config.kind == PolicyKind::kFluxionRules) {
    return page_tokens;
  }
  return std::max(config.block_tokens, page_tokens);
}

ScoredBlocks::Range TopBlocksRange(const PolicyConfig& config, int64_t context,
                                   int64_t page_tokens, double budget_scale) {
  if (config.kind != PolicyKind::kQuest && config.kind != PolicyKind::kFixedBlock) return {};
  SelectionInput in;
  in.context = context;
  in.budget_scale = budget_scale;
  const Regions r = SplitStep(config, in);
  const int64_t block = RankedBlockTokens(config, page_tokens);
  ScoredBlocks::Range range;
  range.first = r.sink_end / block;
  range.end = (r.local_begin + block - 1) / block;
  range.want = range.end > range.first ? r.middle_rows_budget / block : 0;
  return range;
}

int64_t RankedBlocksWanted(const PolicyConfig& config, int64_t context, int64_t page_tokens) {
  return SplitContext(config, context).middle_rows_budget /
         RankedBlockTokens(config, page_tokens);
}

Regions SplitContext(const PolicyConfig& c, int64_t context) {
  Regions r;
  r.sink_end = std::min(c.sink_tokens, context);
  r.local_begin = std::max(r.sink_end, context - c.local_tokens);
  const int64_t budget_rows = static_cast<int64_t>(std::ceil(c.budget * context));
  r.middle_rows_budget = std::clamp<int64_t>(budget_rows - r.sink_end - (context - r.local_begin),
                                             0, r.local_begin - r.sink_end);
  return r;
}

Regions SplitStep(const PolicyConfig& c, const SelectionInput& in) {
  Regions r = SplitContext(c, in.context);
  if (in.budget_scale < 1.0) {
    r.middle_rows_budget = std::clamp<int64_t>(
        std::llround(std::max(0.0, in.budget_scale) * static_cast<double>(r.middle_rows_budget)),
        0, r.middle_rows_budget);
  }
  return r;
}

void AssembleSpans(const SelectionInput& in, const Regions& r, const std::vector<PageSpan>& middle,
                   std::vector<PageSpan>* spans, SelectionStats* stats) {
  AppendTokenRange(*in.kv, in.layer, in.kv_head, 0, r.sink_end, spans);
  spans->insert(spans->end(), middle.begin(), middle.end());
  AppendTokenRange(*in.kv, in.layer, in.kv_head, r.local_begin, in.context, spans);
  int64_t rows = r.sink_end + (in.context - r.local_begin);
  for (const PageSpan& s : middle) rows += s.rows;
  stats->rows_attended += rows;
  stats->context += in.context;
}

CandidateMarks::CandidateMarks(int64_t begin, int64_t end, std::vector<uint64_t>* words)
    : CandidateMarks(begin, end, words, /*clear=*/true) {}

CandidateMarks::CandidateMarks(int64_t begin, int64_t end, std::vector<uint64_t>* words,
                               bool clear)
    : begin_(begin), end_(std::max(begin, end)), words_(words) {
  const size_t n = static_cast<size_t>((end_ - begin_ + 63) / 64);
  if (clear) {
    words_->assign(n, 0);
  } else {
    CHECK_EQ(words_->size(), n) << "CandidateMarks::Marked over another range's bitmap";
  }
}

CandidateMarks CandidateMarks::Marked(int64_t begin, int64_t end, std::vector<uint64_t>* words) {
  return CandidateMarks(begin, end, words, /*clear=*/false);
}

void CandidateMarks::MarkRun(int64_t first, int64_t count) {
  int64_t a = std::max(first, begin_) - begin_;
  const int64_t b = std::min(first + count, end_) - begin_;
  uint64_t* w = words_->data();
  while (a < b) {
    const int64_t bit = a & 63, n = std::min<int64_t>(64 - bit, b - a);
    const uint64_t ones = n == 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1);
    w[a >> 6] |= ones << bit;
    a += n;
  }
}

void CandidateMarks::ReadOut(std::vector<int32_t>* out) const {
  out->clear();
  const uint64_t* w = words_->data();
  for (size_t i = 0; i < words_->size(); ++i) {
    for (uint64_t bits = w[i]; bits != 0; bits &= bits - 1) {
      out->push_back(static_cast<int32_t>(begin_ + static_cast<int64_t>(i) * 64 +
                                          __builtin_ctzll(bits)));
    }
  }
}

void ThinEvenly(int64_t target, int64_t group, std::vector<int32_t>* sorted_positions) {
  std::vector<int32_t>& p = *sorted_positions;
  const int64_t n = static_cast<int64_t>(p.size());
  if (target < 0 || n <= target) return;
  group = std::max<int64_t>(group, 1);
  const int64_t groups = (n + group - 1) / group;
  const int64_t keep = std::min(groups, (target + group - 1) / group);
  // In place: kept group i starts at (i groups / keep) group >= i group, not yet overwritten.
  int64_t size = 0;
  for (int64_t i = 0; i < keep; ++i) {
    const int64_t first = i * groups / keep * group, last = std::min(n, first + group);
    for (int64_t j = first; j < last; ++j) p[size++] = p[j];
  }
  p.resize(size);
}

void AppendPositions(const PagedKv& kv, int layer, int kv_head,
                     const std::vector<int32_t>& sorted_positions, std::vector<PageSpan>* spans) {
  AppendPositions(kv, layer, kv_head, sorted_positions.data(),
                  static_cast<int64_t>(sorted_positions.size()), spans);
}

void AppendPositions(const PagedKv& kv, int layer, int kv_head, const int32_t* sorted_positions,
                     int64_t count, std::vector<PageSpan>* spans) {
  const int64_t pt = kv.shape().page_tokens;
  const auto& pages = kv.pages(layer, kv_head);
  const size_t first = spans->size();
  for (int64_t i = 0; i < count; ++i) {
    const int32_t t = sorted_positions[i];
    const int32_t page = pages[t / pt], row = static_cast<int32_t>(t % pt);
    if (spans->size() > first && spans->back().page == page &&
        spans->back().first_row + spans->back().rows == row) {
      ++spans->back().rows;
    } else {
      spans->push_back({page, row, 1});
    }
  }
}

void ScorePositionsInTasks(const PagedKv& kv, int layer, int kv_head,
                           const std::vector<int32_t>& positions, const float* q, int64_t group,
                           float* group_scores, float* row_max) {
  const int64_t n = static_cast<int64_t>(positions.size());
  const int64_t chunk = kernels::cpu::kScoreRowsPerTask;
  const kernels::PagedKvView view = kv.view();
  kernels::cpu::RunAsTasks((n + chunk - 1) / chunk, [&](int64_t j) {
    // A task runs start to end on one thread (tied, no scheduling point inside), so the
    // thread's span list is its own while it runs; reused, a warm step allocates nothing.
    thread_local std::vector<PageSpan> spans;
    const int64_t first = j * chunk, count = std::min(chunk, n - first);
    spans.clear();
    AppendPositions(kv, layer, kv_head, positions.data() + first, count, &spans);
    float* scores = group_scores + first * group;
    kernels::cpu::GroupScores(view, spans.data(), static_cast<int64_t>(spans.size()), q, group,
                              scores);
    for (int64_t i = 0; i < count; ++i) {
      row_max[first + i] = *std::max_element(scores + i * group, scores + (i + 1) * group);
    }
  });
}

void AppendTokenRange(const PagedKv& kv, int layer, int kv_head, int64_t begin, int64_t end,
                      std::vector<PageSpan>* spans) {
  const int64_t pt = kv.shape().page_tokens;
  const auto& pages = kv.pages(layer, kv_head);
  while (begin < end) {
    const int64_t page = begin / pt, row = begin % pt;
    const int64_t rows = std::min(end - begin, pt - row);
    spans->push_back({pages[page], static_cast<int32_t>(row), static_cast<int32_t>(rows)});
    begin += rows;
  }
}

}  // namespace fluxion::decode::sparse
