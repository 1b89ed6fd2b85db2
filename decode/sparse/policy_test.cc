// Policy identity: a name is parsed into a kind once, and every question about a policy's
// identity is answered by the kind's traits.
#include "decode/sparse/policy.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

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

TEST(PolicyKindTest, UnknownNamesAreInvalidArgumentEverywhere) {
  for (const char* bad : {"", "bogus", "Full", "fluxion2", "quest@0.05", "lfps "}) {
    EXPECT_EQ(ParsePolicyKind(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(ParsePolicy(bad, 0.05).status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(ExpandPolicies({"full", bad}, {0.05}).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
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

}  // namespace
}  // namespace fluxion::decode::sparse
