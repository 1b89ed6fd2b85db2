#include "decode/sparse/decision_profile.h"

#include <cmath>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_replace.h"
#include "decode/step/sparse_attention.h"
#include "gtest/gtest.h"
#include "model/sparse_state.h"

namespace fluxion::decode::sparse {
namespace {

// A measured profile as a file would hold it: Fluxion with streaming heads, bypasses and three
// (block, budget) choices; LFPS with bypasses only.
constexpr char kProfile[] = R"({
  "format": "fluxion-decision-profile/v1", "name": "test", "seed": 7,
  "source": {"command": "by hand"},
  "policies": [
    {"policy": "fluxion", "policy_budget": 0.05, "context": 4000, "sink_tokens": 4,
     "local_tokens": 64, "head_steps": 1000, "streaming_share": 0.3, "bypass_share": 0.1,
     "retrieval": [{"block_tokens": 16, "budget": 0.08, "share": 0.5},
                   {"block_tokens": 32, "budget": 0.05, "share": 0.3},
                   {"block_tokens": 64, "budget": 0.03, "share": 0.2}]},
    {"policy": "lfps", "policy_budget": 0.05, "context": 4000, "sink_tokens": 4,
     "local_tokens": 64, "head_steps": 1000, "streaming_share": 0, "bypass_share": 0.25,
     "retrieval": [{"block_tokens": 1, "budget": 0.05, "share": 1}]}
  ]})";

DecisionProfile Measured() {
  absl::StatusOr<DecisionProfile> p = DecisionProfile::Parse(kProfile);
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

TEST(DecisionProfileTest, ParsesAndSerializesTheSameProfile) {
  const DecisionProfile p = Measured();
  EXPECT_EQ(p.name(), "test");
  EXPECT_EQ(p.seed(), 7u);
  ASSERT_EQ(p.policies().size(), 2u);
  EXPECT_EQ(p.policies()[0].retrieval.size(), 3u);
  absl::StatusOr<DecisionProfile> again = DecisionProfile::Parse(p.Serialize());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->Serialize(), p.Serialize());
}

// Every malformed file is refused with InvalidArgument naming what is wrong.
TEST(DecisionProfileTest, MalformedFilesGiveClearErrors) {
  struct Case {
    std::string from, to, message, from2 = "", to2 = "";
  };
  const std::string good = kProfile;
  const std::vector<Case> cases = {
      {"\"format\"", "\"formats\"", "format must be"},
      {"fluxion-decision-profile/v1", "fluxion-decision-profile/v9", "format must be"},
      {"\"streaming_share\": 0.3", "\"streaming_share\": 1.5",
       "policies[0].streaming_share is 1.5, outside [0, 1]"},
      {"\"bypass_share\": 0.25", "\"bypass_share\": -0.1", "policies[1].bypass_share"},
      {"\"budget\": 0.08", "\"budget\": 0", "policies[0].retrieval[0].budget is 0, outside (0, 1]"},
      {"\"budget\": 0.08", "\"budget\": 1.5", "retrieval[0].budget is 1.5"},
      {"\"block_tokens\": 32", "\"block_tokens\": 24",
       "retrieval[1].block_tokens is 24; fluxion supports 16, 32, 64"},
      {"\"block_tokens\": 1,", "\"block_tokens\": 16,", "lfps supports 1"},
      {"\"share\": 0.5", "\"share\": 0.1", "retrieval shares sum to 0.6"},
      {"\"policy\": \"lfps\"", "\"policy\": \"quest\"", "policy is 'quest'"},
      {"\"policy\": \"lfps\"", "\"policy\": \"fluxion\"", "repeats fluxion at policy_budget 0.05",
       "\"block_tokens\": 1,", "\"block_tokens\": 64,"},
      {"\"head_steps\": 1000, \"streaming_share\": 0.3", "\"streaming_share\": 0.3",
       "policies[0].head_steps must be an integer"},
      {"\"context\": 4000", "\"context\": \"4000\"", "policies[0].context must be an integer"},
      {"\"context\": 4000", "\"context\": 1000", "leaves nothing beyond sinks + window"},
      {"\"name\": \"test\"", "\"name\": \"conservative\"", "built-in profile"},
      {"\"seed\": 7", "\"seed\": -7", "seed must be"},
      {"\"streaming_share\": 0.3, \"bypass_share\": 0.1",
       "\"streaming_share\": 0.7, \"bypass_share\": 0.6", "more than 1"},
      {"  ]}", "  ]", "not valid JSON"},
      {"{\"block_tokens\": 64", "7, {\"block_tokens\": 64", "retrieval[2] must be an object"},
      {"\"bypass_share\": 0.25,", "\"bypass_share\": 0.25, \"rescored_share\": 1.5,",
       "policies[1].rescored_share is 1.5, outside [0, 1]"},
      {"\"bypass_share\": 0.25,", "\"bypass_share\": 0.25, \"rescored_share\": \"x\",",
       "policies[1].rescored_share must be a number"},
  };
  for (const Case& c : cases) {
    std::string text = absl::StrReplaceAll(good, {{c.from, c.to}});
    if (!c.from2.empty()) text = absl::StrReplaceAll(text, {{c.from2, c.to2}});
    ASSERT_NE(text, good) << "case does not apply: " << c.from;
    absl::StatusOr<DecisionProfile> p = DecisionProfile::Parse(text);
    ASSERT_FALSE(p.ok()) << c.from << " -> " << c.to;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(c.message), std::string::npos)
        << c.from << " -> " << c.to << ": " << p.status().message();
  }
  for (const std::string text : {"", "[]", "{}", "nul", "{\"format\": 1}"}) {
    EXPECT_EQ(DecisionProfile::Parse(text).status().code(), absl::StatusCode::kInvalidArgument)
        << text;
  }
  EXPECT_EQ(DecisionProfile::Load("/nonexistent/profile.json").status().code(),
            absl::StatusCode::kNotFound);
}

// The committed profiles stay loadable by this build (bench/profiles/README.md).
TEST(DecisionProfileTest, CommittedProfilesLoad) {
  const char* dir = std::getenv("FLUXION_SOURCE_DIR");
  for (const std::string stem : {"tiny-retrieval-4k", "tiny-retrieval-16k"}) {
    const std::string path =
        std::string(dir != nullptr ? dir : ".") + "/bench/profiles/" + stem + ".json";
    absl::StatusOr<std::shared_ptr<const DecisionProfile>> p = DecisionProfile::Resolve(path);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ((*p)->name(), stem);
    for (const std::string name : {"lfps", "fluxion"}) {
      for (double budget : {0.05, 0.02}) {
        EXPECT_TRUE((*p)->For(*ParsePolicy(name, budget)).ok())
            << stem << " " << name << "@" << budget;
      }
    }
  }
}

TEST(DecisionProfileTest, ForNamesTheBudgetsAProfileHas) {
  const DecisionProfile p = Measured();
  EXPECT_TRUE(p.For(*ParsePolicy("fluxion", 0.05)).ok());
  absl::StatusOr<PolicyDecisions> missing = p.For(*ParsePolicy("fluxion", 0.02));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("it has 0.05"), std::string::npos) << missing.status();
  EXPECT_FALSE(p.For(*ParsePolicy("quest", 0.05)).ok());
  EXPECT_FALSE(DecisionProfile::Conservative().For(*ParsePolicy("fixed_32_0.05", 1)).ok());
}

// The pure draws over 100,000 heads (and as many head-steps) converge to the profile's shares:
// within 0.01 (binomial standard deviation at most 0.0016).
TEST(DecisionProfileTest, DrawsConvergeToTheProfileShares) {
  const DecisionProfile p = Measured();
  const PolicyDecisions d = *p.For(*ParsePolicy("fluxion", 0.05));
  int64_t streaming = 0, bypassed = 0, n = 0;
  std::map<int64_t, int64_t> blocks;
  for (int layer = 0; layer < 1000; ++layer) {
    for (int h = 0; h < 100; ++h, ++n) {
      const HeadReplay r = p.DrawHead(d, layer, h);
      if (r.streaming) {
        ++streaming;
        continue;
      }
      ++blocks[r.block_tokens];
      bypassed += p.DrawBypass(d, layer, h, 4000 + h);
      // Budgets become weights on the uniform middle budget at the recorded context.
      const double window = 68, uniform = std::ceil(0.05 * 4000) - window;
      const double budget = r.block_tokens == 16 ? 0.08 : r.block_tokens == 32 ? 0.05 : 0.03;
      EXPECT_NEAR(r.weight, (budget * 4000 - window) / uniform, 1e-12);
    }
  }
  EXPECT_NEAR(static_cast<double>(streaming) / n, 0.3, 0.01);
  EXPECT_NEAR(static_cast<double>(bypassed) / n, 0.1, 0.01);
  const double retrieval = static_cast<double>(n - streaming);
  EXPECT_NEAR(blocks[16] / retrieval, 0.5, 0.01);
  EXPECT_NEAR(blocks[32] / retrieval, 0.3, 0.01);
  EXPECT_NEAR(blocks[64] / retrieval, 0.2, 0.01);
  // Repeatable.
  EXPECT_EQ(p.DrawHead(d, 3, 4).block_tokens, p.DrawHead(d, 3, 4).block_tokens);
  EXPECT_EQ(p.DrawBypass(d, 3, 4, 100), p.DrawBypass(d, 3, 4, 100));
}

// Random K/V for `layers` x `heads` KV heads of `tokens` positions, head_dim 32, one query head
// per KV head, and the synthesized sparse state the bench uses.
struct RandomRequest {
  RandomRequest(int layers, int heads, int64_t tokens, int64_t steps)
      : shape{layers, heads, 32, 16},
        arena(*KvArena::Create(shape.page_bytes(), layers * heads * ((tokens + steps) / 16 + 2))),
        kv(*PagedKv::Create(arena.get(), shape)) {
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0, 1);
    const int64_t row = heads * shape.head_dim;
    k.resize((tokens + steps) * row);
    v.resize(k.size());
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    for (int l = 0; l < layers; ++l)
      EXPECT_TRUE(kv->Append(l, tokens, k.data(), v.data(), row).ok());
    const model::AttentionShape attn{layers, heads, heads, 32, 1.0f / std::sqrt(32.0f)};
    state = *model::SynthesizeSparseState(attn, tokens);
  }
  KvShape shape;
  std::unique_ptr<KvArena> arena;
  std::unique_ptr<PagedKv> kv;
  std::vector<float> k, v;
  model::SparseState state;
};

// Runs `steps` decode steps of every head of `r` under `config` (one policy object for the
// request, as Fluxion runs); returns the summed stats.
SelectionStats Decode(RandomRequest& r, const PolicyConfig& config, int64_t steps) {
  std::unique_ptr<SparsePolicy> policy = MakePolicy(config);
  const int layers = r.shape.num_layers, heads = r.shape.num_kv_heads;
  for (int l = 0; l < layers; ++l) {
    for (int h = 0; h < heads; ++h) {
      EXPECT_TRUE(policy->Prepare(*r.kv, l, h, &r.state.head(l, h)).ok());
    }
  }
  SelectionStats stats;
  std::vector<kernels::PageSpan> spans;
  std::vector<float> out(32), lse(1);
  const int64_t row = heads * r.shape.head_dim;
  for (int64_t s = 0; s < steps; ++s) {
    for (int l = 0; l < layers; ++l) {
      const int64_t at = r.kv->length(l);
      EXPECT_TRUE(r.kv->Append(l, 1, r.k.data() + at * row, r.v.data() + at * row, row).ok());
      for (int h = 0; h < heads; ++h) {
        const float* q = r.k.data() + (at - 1) * row + h * 32;  // any vector will do
        RunPolicyStep(*policy, {r.kv.get(), l, h, q, 1, 1.0f / std::sqrt(32.0f), at + 1}, &spans,
                      &stats, out.data(), lse.data());
      }
    }
  }
  return stats;
}

// The conservative profile: every head-step of LFPS and Fluxion a retrieval step at the
// configured budget, attending exactly ceil(budget x context) rows; Fluxion at 16-token blocks.
TEST(DecisionProfileTest, ConservativeProfileSpendsTheFullBudgetOnEveryHead) {
  const auto conservative =
      std::make_shared<const DecisionProfile>(DecisionProfile::Conservative());
  for (const std::string name : {"lfps", "fluxion"}) {
    RandomRequest r(4, 4, 2048, 8);
    PolicyConfig config = *ParsePolicy(name, 0.05);
    config.decision_profile = conservative;
    const SelectionStats stats = Decode(r, config, 8);
    EXPECT_EQ(stats.selections, 4 * 4 * 8) << name;
    EXPECT_EQ(stats.streaming, 0) << name;
    EXPECT_EQ(stats.bypassed, 0) << name;
    // Keyed by kBudgetUnit: ceil(0.05 x context) / context moves in the 4th digit per step.
    int64_t retrieval = 0;
    for (const auto& [choice, count] : stats.retrieval) {
      retrieval += count;
      EXPECT_EQ(choice.first, name == "lfps" ? 1 : 16) << name;
      EXPECT_NEAR(choice.second * kBudgetUnit, 0.05, 1e-3) << name;
    }
    EXPECT_EQ(retrieval, stats.selections) << name;
    int64_t want = 0;
    for (int64_t s = 0; s < 8; ++s)
      want += 4 * 4 * static_cast<int64_t>(std::ceil(0.05 * (2049 + s)));
    EXPECT_EQ(stats.rows_attended, want) << name;
  }
}

// Replay through the policies reproduces the profile's shares over 512 heads x 6 steps: within
// 0.06 for the per-head streaming share and 0.08 for the per-head block shares (3 binomial
// standard deviations over 512 and ~360 heads), 0.03 for the per-step bypass share.
TEST(DecisionProfileTest, ReplayThroughThePoliciesReproducesTheShares) {
  const auto profile = std::make_shared<const DecisionProfile>(Measured());
  RandomRequest r(64, 8, 2048, 6);
  PolicyConfig config = *ParsePolicy("fluxion", 0.05);
  config.decision_profile = profile;
  const SelectionStats stats = Decode(r, config, 6);
  const double n = static_cast<double>(stats.selections);
  ASSERT_EQ(stats.selections, 64 * 8 * 6);
  EXPECT_NEAR(stats.streaming / n, 0.3, 0.06);
  EXPECT_NEAR(stats.bypassed / n, 0.1, 0.03);
  std::map<int64_t, int64_t> blocks;
  int64_t retrieval = 0;
  for (const auto& [choice, count] : stats.retrieval) {
    blocks[choice.first] += count;
    retrieval += count;
  }
  EXPECT_EQ(retrieval, stats.selections - stats.streaming - stats.bypassed);
  EXPECT_NEAR(blocks[16] / static_cast<double>(retrieval), 0.5, 0.08);
  EXPECT_NEAR(blocks[32] / static_cast<double>(retrieval), 0.3, 0.08);
  EXPECT_NEAR(blocks[64] / static_cast<double>(retrieval), 0.2, 0.08);

  // Recording what replay decided gives back the profile's shares (the recorder's own view).
  DecisionRecorder recorder;
  recorder.Add(config, stats);
  absl::StatusOr<DecisionProfile> recorded = recorder.Build("again", "{}");
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  ASSERT_EQ(recorded->policies().size(), 1u);
  EXPECT_NEAR(recorded->policies()[0].streaming_share, stats.streaming / n, 1e-12);
}

// A recorded candidate volume: written only when recorded (older files read back unchanged) and
// replayed by thinning each head-step's candidates to it, never below the budget. Random K/V
// fill the tables, so the policy's own candidates are far more than the recorded share; the
// attended rows (the budget) do not change.
TEST(DecisionProfileTest, RecordedCandidateVolumeReplays) {
  EXPECT_EQ(Measured().Serialize().find("rescored_share"), std::string::npos);
  const std::string text = absl::StrReplaceAll(
      kProfile, {{"\"bypass_share\": 0.25,", "\"bypass_share\": 0, \"rescored_share\": 0.08,"}});
  absl::StatusOr<DecisionProfile> p = DecisionProfile::Parse(text);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->policies()[1].rescored_share, 0.08);
  absl::StatusOr<DecisionProfile> again = DecisionProfile::Parse(p->Serialize());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->policies()[1].rescored_share, 0.08);

  auto share = [](const SelectionStats& s) {
    return static_cast<double>(s.candidate_rows) / static_cast<double>(s.candidate_context);
  };
  PolicyConfig own = *ParsePolicy("lfps", 0.05);
  own.decision_profile = std::make_shared<const DecisionProfile>(DecisionProfile::Conservative());
  PolicyConfig thinned = own;
  thinned.decision_profile = std::make_shared<const DecisionProfile>(*p);
  RandomRequest r1(2, 4, 2048, 8), r2(2, 4, 2048, 8);
  const SelectionStats a = Decode(r1, own, 8), b = Decode(r2, thinned, 8);
  ASSERT_GT(a.candidate_steps, 0);
  EXPECT_EQ(b.candidate_steps, a.candidate_steps);  // the same refreshes and candidate steps
  EXPECT_GT(share(a), 0.15);  // the random tables' own volume, well above the recorded one
  EXPECT_NEAR(share(b), 0.08, 0.003);  // whole groups of 4: up to 3 rows more a step
  EXPECT_EQ(b.rows_attended, a.rows_attended);

  // The recorder reads the volume back from the stats, and leaves other policies out.
  DecisionRecorder recorder;
  recorder.Add(thinned, b);
  recorder.Add(*ParsePolicy("lfps_paper", 0.05), b);
  absl::StatusOr<DecisionProfile> recorded = recorder.Build("again", "{}");
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  ASSERT_EQ(recorded->policies().size(), 1u);
  EXPECT_NEAR(recorded->policies()[0].rescored_share, share(b), 1e-12);
}

}  // namespace
}  // namespace fluxion::decode::sparse
