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
#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
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

}  // namespace
}  // namespace fluxion::decode::sparse
