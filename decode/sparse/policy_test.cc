// Policy identity: a name is parsed into a kind once, and every question about a policy's
// identity is answered by the kind's traits.
#include "decode/sparse/policy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "decode/kv_arena.h"
#include "decode/paged_kv.h"
#include "decode/sparse/error_guard.h"
#include "decode/sparse/policy_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/cpu/selection.h"

namespace fluxion::decode::sparse {
namespace {

TEST(PolicyKindTest, EveryKnownNameParsesAndRoundTripsThroughItsTraits) {
  for (const std::string& name : PolicyNames()) {
    if (name == "fixed_<block>_<budget>") continue;  // a pattern, not a name
    absl::StatusOr<PolicyKind> kind = ParsePolicyKind(name);
    ASSERT_TRUE(kind.ok()) << name << ": " << kind.status();
    EXPECT_EQ(TraitsOf(*kind).name, name);
    absl::StatusOr<PolicyConfig> config = ParsePolicy(name, 0.05);
    ASSERT_TRUE(config.ok()) << name;
    EXPECT_EQ(config->kind, *kind);
    EXPECT_NE(MakePolicy(*config), nullptr) << name;
  }
  EXPECT_EQ(*ParsePolicyKind("fixed_32_0.05"), PolicyKind::kFixedBlock);
}

TEST(PolicyKindTest, SparseStateIsNeededExactlyByTheHistoryPolicies) {
  std::set<std::string> needing;
  for (const std::string& name : PolicyNames()) {
    if (name == "fixed_<block>_<budget>") continue;
    if (TraitsOf(*ParsePolicyKind(name)).needs_sparse_state) needing.insert(name);
  }
  EXPECT_EQ(needing, (std::set<std::string>{"lfps", "lfps_paper", "fluxion", "fluxion_rules"}));
  EXPECT_TRUE(TraitsOf(PolicyKind::kFluxion).uses_predictor);
  EXPECT_FALSE(TraitsOf(PolicyKind::kFluxionRules).uses_predictor);
}

// The guard takes relaxations only where the policy can find again what it gives back: Fluxion
// (query-aware scan) yes, LFPS (candidates from its own history) no; the rest is config.guard.
TEST(PolicyKindTest, TheGuardRelaxesFluxionHeadsButNeverLfpsHeads) {
  for (const char* name : {"lfps", "fluxion"}) {
    PolicyConfig c = *ParsePolicy(name, 0.02);
    c.guard.enabled = true;
    c.guard.relax_ratio = 0.3;
    c.guard.tolerance = 0.7;
    c.guard.sample_rate = 1.0;
    const GuardConfig g = GuardFor(c);
    EXPECT_EQ(g.relax_ratio, std::string(name) == "fluxion" ? 0.3 : 0.0) << name;
    EXPECT_EQ(g.tolerance, 0.7) << name;
    // An LFPS head checked far below tolerance, again and again, keeps its budget.
    ErrorGuard guard(g, 1, 4, [](int, int) { return 1.0; });
    for (int step = 0; step < 8; ++step) {
      guard.BeginStep();
      for (int h = 0; h < 4; ++h) {
        if (guard.Due(0, h)) guard.Report(0, h, /*error=*/0.001, /*rows_read=*/10);
      }
    }
    EXPECT_EQ(guard.stats().relaxations > 0, std::string(name) == "fluxion") << name;
  }
}

TEST(PolicyKindTest, UnknownNamesAreInvalidArgumentEverywhere) {
  for (const char* bad : {"", "bogus", "Full", "fluxion2", "quest@0.05", "lfps "}) {
    EXPECT_EQ(ParsePolicyKind(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(ParsePolicy(bad, 0.05).status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(ExpandPolicies({"full", bad}, {0.05}).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(PolicyKindTest, HistoryPoliciesTakeARescoreCapSuffix) {
  EXPECT_EQ(ParsePolicy("lfps", 0.05)->rescore_cap, kDefaultRescoreCap);
  for (const char* name : {"lfps", "lfps_paper", "fluxion", "fluxion_rules"}) {
    absl::StatusOr<PolicyConfig> c = ParsePolicy(absl::StrCat(name, "_cap4"), 0.05);
    ASSERT_TRUE(c.ok()) << name << ": " << c.status();
    EXPECT_EQ(c->kind, *ParsePolicyKind(name));
    EXPECT_EQ(c->rescore_cap, 4.0);
    EXPECT_EQ(PolicyLabel(*c), absl::StrCat(name, "_cap4@0.05"));
    EXPECT_TRUE(ReadsPageScores(*c)) << name;
  }
  EXPECT_EQ(ParsePolicy("fluxion_cap0", 0.05)->rescore_cap, 0.0);
  EXPECT_EQ(ParsePolicy("lfps_cap2.5", 0.05)->rescore_cap, 2.5);
  EXPECT_FALSE(ReadsPageScores(*ParsePolicy("lfps_cap0", 0.05)));
  for (const char* bad : {"quest_cap4", "full_cap2", "exact_topk_cap4", "lfps_cap", "lfps_cap0.5",
                          "lfps_capx", "lfps_cap-1", "lfps_capnan", "lfps_cap1e9", "_cap4"}) {
    EXPECT_EQ(ParsePolicy(bad, 0.05).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(PolicyKindTest, LfpsTakesABlockGranularTableSuffix) {
  EXPECT_EQ(ParsePolicy("lfps", 0.05)->table_block, 1);
  for (const char* name : {"lfps", "lfps_paper"}) {
    absl::StatusOr<PolicyConfig> c = ParsePolicy(absl::StrCat(name, "_b16"), 0.05);
    ASSERT_TRUE(c.ok()) << name << ": " << c.status();
    EXPECT_EQ(c->kind, *ParsePolicyKind(name));
    EXPECT_EQ(c->table_block, 16);
    EXPECT_EQ(PolicyLabel(*c), absl::StrCat(name, "_b16@0.05"));
  }
  for (const char* bad : {"fluxion_b16", "quest_b16", "full_b16", "lfps_b0", "lfps_b", "lfps_bx",
                          "lfps_b2000", "lfps_b-4", "_b16"}) {
    EXPECT_EQ(ParsePolicy(bad, 0.05).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(PolicyKindTest, BudgetFreePoliciesExpandOnceAndLabelWithoutBudget) {
  absl::StatusOr<std::vector<PolicyConfig>> configs =
      ExpandPolicies({"full", "fixed_32_0.05", "quest"}, {0.02, 0.05});
  ASSERT_TRUE(configs.ok());
  ASSERT_EQ(configs->size(), 4u);
  EXPECT_EQ(PolicyLabel((*configs)[0]), "full");
  EXPECT_EQ(PolicyLabel((*configs)[1]), "fixed_32_0.05");
  EXPECT_EQ((*configs)[1].block_tokens, 32);
  EXPECT_EQ(PolicyLabel((*configs)[2]), "quest@0.02");
  EXPECT_EQ(PolicyLabel(PolicyConfig{}), "full");
}

// One KV head (head_dim 32, 16-token pages) holding `context` random keys and values, and a
// random query for its GQA group.
struct RandomHead {
  static constexpr int64_t kHeadDim = 32;
  RandomHead(int64_t context, int64_t group, uint32_t seed) {
    const KvShape shape{1, 1, kHeadDim, 16};
    arena = *KvArena::Create(shape.page_bytes(), context / 16 + 2);
    kv = *PagedKv::Create(arena.get(), shape);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> k(context * kHeadDim), v(context * kHeadDim);
    q.resize(group * kHeadDim);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    for (float& x : q) x = normal(rng);
    EXPECT_TRUE(kv->Append(0, context, k.data(), v.data(), kHeadDim).ok());
  }
  std::unique_ptr<KvArena> arena;  // before kv: the pages outlive their table
  std::unique_ptr<PagedKv> kv;
  std::vector<float> q;
};

// The rescoring in tasks (each building its own spans) writes what one walk over
// AppendPositions' spans writes, bit for bit, and the group's max of each row; run from a
// ParallelFor task as the step runs it, so the chunks really are tasks of other threads.
TEST(ScorePositionsInTasksTest, EqualsOneWalkOverTheSpansBitForBit) {
  constexpr int64_t kContext = 5 * kernels::cpu::kScoreRowsPerTask + 700, kGroup = 4;
  const RandomHead head(kContext, kGroup, 11);
  std::mt19937 rng(2);
  std::vector<int32_t> positions;
  for (int32_t t = 0; t < kContext; ++t) {
    if (rng() % 3 != 0) positions.push_back(t);  // runs, gaps and page crossings
  }
  std::vector<kernels::PageSpan> spans;
  AppendPositions(*head.kv, 0, 0, positions, &spans);
  const int64_t n = static_cast<int64_t>(positions.size());
  std::vector<float> want(n * kGroup);
  kernels::cpu::GroupScores(head.kv->view(), spans.data(), static_cast<int64_t>(spans.size()),
                            head.q.data(), kGroup, want.data());
  std::vector<float> got(n * kGroup, NAN), row_max(n, NAN);
  const kernels::cpu::CpuPool pool(2);
  pool.ParallelFor(2, [&](int64_t i) {  // of one, it would run outside a parallel region
    if (i == 0) {
      ScorePositionsInTasks(*head.kv, 0, 0, positions, head.q.data(), kGroup, got.data(),
                            row_max.data());
    }
  });
  ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)));
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(row_max[i], *std::max_element(&want[i * kGroup], &want[(i + 1) * kGroup])) << i;
  }
  // No positions: nothing written, nothing read.
  ScorePositionsInTasks(*head.kv, 0, 0, {}, head.q.data(), kGroup, nullptr, nullptr);
}

// SelectionInput::budget_scale (the hybrid step's stall guard) shrinks what every policy that
// reads the middle region reads there, sinks and window untouched.
TEST(PolicyBudgetScaleTest, EveryMiddleReadingPolicySpendsTheScaledShare) {
  constexpr int64_t kContext = 4096, kGroup = 2;
  const RandomHead head(kContext, kGroup, 3);
  const std::unique_ptr<PagedKv>& kv = head.kv;
  const std::vector<float>& q = head.q;
  for (const char* name : {"exact_topk", "quest", "fixed_16_0.2", "lfps", "fluxion_rules"}) {
    SCOPED_TRACE(name);
    const PolicyConfig config = *ParsePolicy(name, 0.2);
    auto middle_rows = [&](double scale) {
      auto policy = MakePolicy(config);
      EXPECT_TRUE(policy->Prepare(*kv, 0, 0, nullptr).ok());
      SelectionInput in{kv.get(), 0, 0, q.data(), kGroup, 0.125f, kContext};
      in.budget_scale = scale;
      std::vector<kernels::PageSpan> spans;
      SelectionStats stats;
      policy->Select(in, &spans, &stats);
      return stats.rows_attended - config.sink_tokens - config.local_tokens;
    };
    const int64_t whole = middle_rows(1.0), half = middle_rows(0.5);
    EXPECT_GT(whole, 600) << "the budget's middle: 0.2 x 4096 - 68 = 751";
    // Half the rows, up to one block of the policy's granularity.
    EXPECT_NEAR(static_cast<double>(half), whole / 2.0, 16.0);
  }
}

// Quest / fixed_*: the blocks ranked elsewhere (the hybrid step's window) are taken as given when
// their range is the one the policy ranks, and ignored otherwise.
TEST(TopRankedBlocksTest, QuestTakesTheWindowsPicksOnlyForItsOwnRange) {
  constexpr int64_t kContext = 2048, kGroup = 2;
  const RandomHead head(kContext, kGroup, 5);
  const std::unique_ptr<PagedKv>& kv = head.kv;
  const std::vector<float>& q = head.q;
  const PolicyConfig config = *ParsePolicy("fixed_32_0.1", 0);
  const ScoredBlocks::Range range = TopBlocksRange(config, kContext, 16);
  EXPECT_EQ(range.first, 0);                                  // sink 4 tokens: block 0
  EXPECT_EQ(range.end, (kContext - 64 + 31) / 32);            // up to the window's first block
  EXPECT_EQ(range.want, (205 - 4 - 64) / 32);                 // ceil(0.1 x 2048) rows, whole blocks
  EXPECT_EQ(TopBlocksRange(*ParsePolicy("lfps", 0.1), kContext, 16).want, 0);
  // The lowest-numbered middle blocks after block 0: not what the scores would pick.
  std::vector<int32_t> given;
  for (int64_t b = 1; b <= range.want; ++b) given.push_back(static_cast<int32_t>(b));
  auto middle_starts = [&](const int32_t* top, ScoredBlocks::Range r) {
    auto policy = MakePolicy(config);
    EXPECT_TRUE(policy->Prepare(*kv, 0, 0, nullptr).ok());
    SelectionInput in{kv.get(), 0, 0, q.data(), kGroup, 0.125f, kContext};
    in.top_blocks = top;
    in.top_range = r;
    std::vector<kernels::PageSpan> spans;
    SelectionStats stats;
    policy->Select(in, &spans, &stats);
    const auto& pages = kv->pages(0, 0);
    std::set<int64_t> blocks;  // the 32-token blocks the middle spans fall in
    for (const kernels::PageSpan& sp : spans) {
      const int64_t index = std::find(pages.begin(), pages.end(), sp.page) - pages.begin();
      const int64_t token = index * 16 + sp.first_row;
      if (token >= 4 && token < kContext - 64) blocks.insert(token / 32);
    }
    return std::vector<int64_t>(blocks.begin(), blocks.end());
  };
  const std::vector<int64_t> as_given = middle_starts(given.data(), range);
  EXPECT_EQ(as_given, std::vector<int64_t>(given.begin(), given.end()));
  ScoredBlocks::Range other = range;
  ++other.want;  // another budget: the picks are not for this step
  const std::vector<int64_t> own = middle_starts(given.data(), other);
  EXPECT_EQ(own, middle_starts(nullptr, {}));
  EXPECT_NE(own, as_given);
}

}  // namespace
}  // namespace fluxion::decode::sparse
