#include "decode/sparse/fluxion_predictor.h"

#include <cmath>
#include <fstream>
#include <random>
#include <string>

#include "common/test_temp_dir.h"
#include "decode/sparse/fluxion_policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace fluxion::decode::sparse {
namespace {

using ::testing::HasSubstr;
using nlohmann::json;

// A valid version-1 file whose streaming classifier says `streaming_bias` (with zero weights the
// bias alone decides) and whose tier classifier says `tier_bias`.
json GoodFile(double streaming_bias = -3.0, double tier_bias = 3.0) {
  return {{"version", 1},
          {"features", {"middle_share", "need_fraction", "sink_mass", "local_mass", "entropy",
                        "layer_frac"}},
          {"mean", {0.5, 0.1, 0.3, 0.4, 3.0, 0.4}},
          {"scale", {0.2, 0.05, 0.2, 0.2, 1.0, 0.3}},
          {"tau", 0.02},
          {"streaming", {{"weights", {0, 0, 0, 0, 0, 0}}, {"bias", streaming_bias}}},
          {"tier", {{"weights", {0, 0, 0, 0, 0, 0}}, {"bias", tier_bias}, {"tiers", {0.02, 0.05}}}}};
}

TEST(FluxionPredictorTest, ParsesAGoodFileAndPredicts) {
  auto p = FluxionPredictor::Parse(GoodFile().dump());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_DOUBLE_EQ(p->tau(), 0.02);
  const HeadPrediction h = p->Predict({0.9, 0.2, 0.05, 0.05, 4.0, 0.5});
  EXPECT_FALSE(h.streaming);
  EXPECT_DOUBLE_EQ(h.tier, 0.05);
  EXPECT_NEAR(h.p_streaming, 1.0 / (1.0 + std::exp(3.0)), 1e-12);
}

TEST(FluxionPredictorTest, WeightsActOnStandardisedFeatures) {
  json f = GoodFile(0.0, 0.0);
  f["streaming"]["weights"] = {-1, 0, 0, 0, 0, 0};  // low middle share -> streaming
  auto p = FluxionPredictor::Parse(f.dump());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->Predict({0.1, 0, 0, 0, 0, 0}).streaming);
  EXPECT_EQ(p->Predict({0.1, 0, 0, 0, 0, 0}).tier, 0.0);
  EXPECT_FALSE(p->Predict({0.9, 0, 0, 0, 0, 0}).streaming);
  EXPECT_NEAR(p->Predict({0.7, 0, 0, 0, 0, 0}).p_streaming, 1.0 / (1.0 + std::exp(1.0)), 1e-12);
}

// Every kind of bad file is InvalidArgument naming what is wrong, never a crash.
TEST(FluxionPredictorTest, RejectsEveryKindOfBadFile) {
  struct Case {
    std::string name, text, message;
  };
  std::vector<Case> cases;
  auto with = [&](const std::string& name, const std::function<void(json&)>& edit,
                  const std::string& message) {
    json f = GoodFile();
    edit(f);
    cases.push_back({name, f.dump(), message});
  };
  cases.push_back({"not json", "{\"version\": 1,", "not valid JSON"});
  cases.push_back({"array", "[1, 2]", "not a JSON object"});
  with("no version", [](json& f) { f.erase("version"); }, "version");
  with("future version", [](json& f) { f["version"] = 2; }, "version 2 is not supported");
  with("no features", [](json& f) { f.erase("features"); }, "features");
  with("five features", [](json& f) { f["features"].erase(5); }, "differ");
  with("reordered features", [](json& f) { std::swap(f["features"][0], f["features"][1]); },
       "differ");
  with("short mean", [](json& f) { f["mean"].erase(0); }, "mean has 5 values");
  with("string in mean", [](json& f) { f["mean"][2] = "x"; }, "mean[2]");
  with("zero scale", [](json& f) { f["scale"][1] = 0.0; }, "scale[1] must be > 0");
  with("negative scale", [](json& f) { f["scale"][4] = -1.0; }, "scale[4]");
  with("no tau", [](json& f) { f.erase("tau"); }, "tau");
  with("tau out of range", [](json& f) { f["tau"] = 1.5; }, "tau must lie in (0, 1)");
  with("no streaming", [](json& f) { f.erase("streaming"); }, "streaming");
  with("short streaming weights", [](json& f) { f["streaming"]["weights"].erase(0); },
       "streaming.weights has 5 values");
  with("streaming bias string", [](json& f) { f["streaming"]["bias"] = "0"; },
       "streaming.bias must be a number");
  with("bad threshold", [](json& f) { f["streaming"]["threshold"] = 1.0; }, "threshold");
  with("no tier", [](json& f) { f.erase("tier"); }, "tier");
  with("tier bias missing", [](json& f) { f["tier"].erase("bias"); }, "tier.bias");
  with("three tiers", [](json& f) { f["tier"]["tiers"] = {0.02, 0.05, 0.1}; }, "tier.tiers");
  with("zero tier", [](json& f) { f["tier"]["tiers"][0] = 0.0; }, "tier.tiers[0]");
  // JSON has no NaN or infinity literals; a number that overflows double is refused as well.
  cases.push_back({"overflowing bias",
                   [] {
                     std::string t = GoodFile().dump();
                     return t.replace(t.find("\"bias\":-3.0"), 11, "\"bias\":-1e999");
                   }(),
                   "not valid JSON"});
  for (const Case& c : cases) {
    auto p = FluxionPredictor::Parse(c.text);
    ASSERT_FALSE(p.ok()) << c.name;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(p.status().message(), HasSubstr(c.message)) << c.name << ": " << p.status();
  }
}

TEST(FluxionPredictorTest, LoadNamesAMissingFile) {
  auto p = FluxionPredictor::Load("/nonexistent/fluxion_predictor.json");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(p.status().message(), HasSubstr("/nonexistent/fluxion_predictor.json"));
}

TEST(FluxionPredictorTest, ResolveFallsBackWithoutAFileAndHonoursNone) {
  auto none = ResolvePredictor("", "/nonexistent-model-dir");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
  ScopedTestTempDir temp;
  const std::string dir = temp.dir();
  std::ofstream(dir + "/" + kPredictorFileName) << GoodFile().dump();
  auto beside = ResolvePredictor("", dir);
  ASSERT_TRUE(beside.ok()) << beside.status();
  EXPECT_NE(*beside, nullptr);
  auto off = ResolvePredictor("none", dir);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(*off, nullptr);
  std::ofstream(dir + "/bad.json") << "{}";
  auto bad = ResolvePredictor(dir + "/bad.json", dir);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("bad.json"));
}

// Commands that run `fluxion` refuse a model without a predictor, naming the two ways out; "none"
// is the explicit way to the rules, and a predictor beside the weights is used as before.
TEST(FluxionPredictorTest, RequireRefusesAModelWithoutOneUnlessToldNone) {
  ScopedTestTempDir temp;
  const std::string dir = temp.dir();
  auto missing = RequirePredictor("", dir);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir));
  EXPECT_THAT(missing.status().message(), HasSubstr("--fluxion-predictor none"));
  EXPECT_THAT(missing.status().message(), HasSubstr("fluxion calibrate --model " + dir));
  auto rules = RequirePredictor("none", dir);
  ASSERT_TRUE(rules.ok()) << rules.status();
  EXPECT_EQ(*rules, nullptr);
  std::ofstream(dir + "/" + kPredictorFileName) << GoodFile().dump();
  auto beside = RequirePredictor("", dir);
  ASSERT_TRUE(beside.ok()) << beside.status();
  EXPECT_NE(*beside, nullptr);
}

// Four KV heads over one layer, random keys, prepared with neutral sparse states: what budget
// each head reads is then decided by the predictor alone.
class FluxionWithPredictorTest : public ::testing::Test {
 protected:
  static constexpr int64_t kTokens = 2048, kD = 32, kHeads = 4;

  void SetUp() override {
    const KvShape shape{1, kHeads, kD, 16};
    arena_ = *KvArena::Create(shape.page_bytes(), kHeads * (kTokens / 16 + 2));
    kv_ = *PagedKv::Create(arena_.get(), shape);
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> k(kTokens * kHeads * kD), v(k.size());
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    q_.resize(kD);
    for (float& x : q_) x = normal(rng);
    ASSERT_TRUE(kv_->Append(0, kTokens, k.data(), v.data(), kHeads * kD).ok());
  }

  // Rows each head attends at one step of `policy` at budget 0.1.
  std::vector<int64_t> RowsPerHead(std::shared_ptr<const FluxionPredictor> predictor,
                                   const std::string& name = "fluxion") {
    PolicyConfig config = *ParsePolicy(name, 0.1);
    config.fluxion_predictor = std::move(predictor);
    std::unique_ptr<SparsePolicy> policy = MakePolicy(config);
    model::HeadSparseState state;  // middle share 1: the rules call every head retrieval
    for (int h = 0; h < kHeads; ++h) EXPECT_TRUE(policy->Prepare(*kv_, 0, h, &state).ok());
    std::vector<int64_t> rows;
    const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
    for (int h = 0; h < kHeads; ++h) {
      SelectionStats stats;
      std::vector<kernels::PageSpan> spans;
      policy->Select({kv_.get(), 0, h, q_.data(), 1, scale, kTokens}, &spans, &stats);
      rows.push_back(stats.rows_attended);
    }
    return rows;
  }

  std::unique_ptr<KvArena> arena_;
  std::unique_ptr<PagedKv> kv_;
  std::vector<float> q_;
};

TEST_F(FluxionWithPredictorTest, AllStreamingPredictionGivesZeroMiddleBudget) {
  auto p = std::make_shared<const FluxionPredictor>(*FluxionPredictor::Parse(GoodFile(5.0).dump()));
  for (int64_t rows : RowsPerHead(p)) EXPECT_EQ(rows, 4 + 64);  // sinks + window only
}

TEST_F(FluxionWithPredictorTest, AllRetrievalAtTopTierKeepsTheUniformBudget) {
  auto p = std::make_shared<const FluxionPredictor>(
      *FluxionPredictor::Parse(GoodFile(-5.0, 5.0).dump()));
  const int64_t uniform = static_cast<int64_t>(std::ceil(0.1 * kTokens));
  for (int64_t rows : RowsPerHead(p)) EXPECT_EQ(rows, uniform);
}

TEST_F(FluxionWithPredictorTest, WithoutPredictorFluxionFollowsTheRulesLikeFluxionRules) {
  auto p = std::make_shared<const FluxionPredictor>(*FluxionPredictor::Parse(GoodFile(5.0).dump()));
  // `fluxion_rules` ignores a configured predictor; `fluxion` without one is the same fallback.
  EXPECT_EQ(RowsPerHead(p, "fluxion_rules"), RowsPerHead(nullptr, "fluxion"));
  const int64_t uniform = static_cast<int64_t>(std::ceil(0.1 * kTokens));
  for (int64_t rows : RowsPerHead(nullptr)) EXPECT_EQ(rows, uniform);  // equal states, equal split
}

TEST(FluxionRulesPolicyTest, ParsesAndIsListed) {
  auto c = ParsePolicy("fluxion_rules", 0.05);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(PolicyLabel(*c), "fluxion_rules@0.05");
  const std::vector<std::string> names = PolicyNames();
  EXPECT_NE(std::find(names.begin(), names.end(), "fluxion_rules"), names.end());
}

}  // namespace
}  // namespace fluxion::decode::sparse
