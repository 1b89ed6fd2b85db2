// `fluxion eval compare` on hand-made eval JSON: the classification of each sample (identical,
// near-tie, divergence), the measured noise, the pairing, and the refusal of malformed files.
#include "bench/eval/eval_compare.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::eval {
namespace {

using ::nlohmann::json;
using ::testing::HasSubstr;

json Sample(const std::string& task, uint64_t seed, const std::string& policy,
            std::vector<int32_t> tokens, std::vector<float> margins, std::vector<float> top_logits,
            bool correct) {
  return {{"task", task},
          {"context", 1024},
          {"seed", seed},
          {"policy", policy},
          {"tokens", tokens},
          {"margins", margins},
          {"top_logits", top_logits},
          {"correct", correct}};
}

json Doc(const std::string& device, std::vector<json> samples) {
  json doc = {{"device", device}, {"samples", json::array()}};
  for (json& s : samples) doc["samples"].push_back(std::move(s));
  return doc;
}

EvalComparison Compare(const json& a, const json& b, double relative = 0.04) {
  absl::StatusOr<EvalRun> ra = ParseEvalRun(a, "A.json");
  absl::StatusOr<EvalRun> rb = ParseEvalRun(b, "B.json");
  EXPECT_TRUE(ra.ok()) << ra.status();
  EXPECT_TRUE(rb.ok()) << rb.status();
  CompareOptions options;
  options.near_tie_relative = relative;
  return CompareEvalRuns(*ra, *rb, options);
}

TEST(EvalCompareTest, SameTokensAreIdenticalWhateverTheMargins) {
  const json a = Doc(
      "cpu", {Sample("vt", 1000000, "full", {'4', '2', '\n'}, {5, 0.01f, 3}, {10, 10, 10}, true)});
  const json b =
      Doc("cuda",
          {Sample("vt", 1000000, "full", {'4', '2', '\n'}, {5, 0.02f, 3}, {10.1f, 10, 10}, true)});
  const EvalComparison c = Compare(a, b);
  EXPECT_EQ(c.device_a, "cpu");
  EXPECT_EQ(c.device_b, "cuda");
  ASSERT_EQ(c.samples.size(), 1u);
  EXPECT_EQ(c.samples[0].verdict, Verdict::kIdentical);
  EXPECT_EQ(c.identical, 1);
  EXPECT_EQ(c.near_ties + c.divergences + c.correct_flips, 0);
}

TEST(EvalCompareTest, AFirstDifferenceAtASmallMarginIsANearTie) {
  // Step 2 differs; A chose '2' there by 0.05 over its runner-up at a top logit of 10: within
  // 0.04 x 10 = 0.4. The answer's score flipped too, which the near-tie excuses.
  const json a = Doc("cpu", {Sample("vt", 7, "quest@0.05", {'4', '1', '2', '\n'}, {5, 4, 0.05f, 3},
                                    {10, 10, 10, 10}, true)});
  const json b = Doc("cuda", {Sample("vt", 7, "quest@0.05", {'4', '1', '3', '\n'}, {5, 4, 0.02f, 3},
                                     {10, 10, 10, 10}, false)});
  const EvalComparison c = Compare(a, b);
  ASSERT_EQ(c.samples.size(), 1u);
  const SampleComparison& s = c.samples[0];
  EXPECT_EQ(s.verdict, Verdict::kNearTie);
  EXPECT_EQ(s.first_diff_step, 2);
  EXPECT_EQ(s.token_a, '2');
  EXPECT_EQ(s.token_b, '3');
  EXPECT_FLOAT_EQ(s.margin_a, 0.05f);
  EXPECT_FLOAT_EQ(s.threshold, 0.4f);
  EXPECT_FLOAT_EQ(s.margin_b, 0.02f);
  EXPECT_EQ(c.near_ties, 1);
  EXPECT_EQ(c.divergences, 0);
  EXPECT_EQ(c.correct_flips, 1);
}

TEST(EvalCompareTest, AFirstDifferenceAtAClearMarginIsADivergence) {
  const json a =
      Doc("cpu",
          {Sample("niah_single", 7, "lfps@0.05", {'4', '1', '\n'}, {5, 3, 3}, {10, 10, 10}, true)});
  const json b = Doc("cuda", {Sample("niah_single", 7, "lfps@0.05", {'4', '9', '\n'}, {5, 1, 3},
                                     {10, 10, 10}, false)});
  const EvalComparison c = Compare(a, b);
  ASSERT_EQ(c.samples.size(), 1u);
  EXPECT_EQ(c.samples[0].verdict, Verdict::kDivergence);
  EXPECT_EQ(c.samples[0].first_diff_step, 1);
  EXPECT_EQ(c.divergences, 1);
  // A looser threshold makes the same margin (3 of a top logit 10) a near-tie.
  EXPECT_EQ(Compare(a, b, 0.5).samples[0].verdict, Verdict::kNearTie);
}

TEST(EvalCompareTest, TheThresholdScalesWithTheTopLogitButNeverBelowOne) {
  // Top logit 0.2: the scale is max(1, 0.2) = 1, so the threshold is 0.04 and 0.03 is a near-tie
  // (a purely relative threshold, 0.008, would call it a divergence).
  const json a = Doc("cpu", {Sample("vt", 7, "full", {'1', '2'}, {5, 0.03f}, {0.2f, 0.2f}, false)});
  const json b = Doc("cpu", {Sample("vt", 7, "full", {'1', '3'}, {5, 0.01f}, {0.2f, 0.2f}, false)});
  const SampleComparison s = Compare(a, b).samples[0];
  EXPECT_FLOAT_EQ(s.threshold, 0.04f);
  EXPECT_EQ(s.verdict, Verdict::kNearTie);
}

TEST(EvalCompareTest, ARunThatStopsEarlierIsJudgedAtTheStepWhereTheOtherGoesOn) {
  // B chose the terminator at step 2 where A chose '7' by a clear margin: a divergence at step
  // 2; A's list is the longer one so B's token there is '\n'.
  const json a =
      Doc("cpu",
          {Sample("vt", 7, "full", {'1', '2', '7', '\n'}, {5, 5, 4, 5}, {10, 10, 10, 10}, false)});
  const json b =
      Doc("cpu", {Sample("vt", 7, "full", {'1', '2', '\n'}, {5, 5, 1}, {10, 10, 10}, true)});
  const SampleComparison s = Compare(a, b).samples[0];
  EXPECT_EQ(s.first_diff_step, 2);
  EXPECT_EQ(s.token_b, '\n');
  EXPECT_EQ(s.verdict, Verdict::kDivergence);
  // The same tokens, one run cut shorter (another --max-new-tokens): no choice to judge.
  const json cut = Doc("cpu", {Sample("vt", 7, "full", {'1', '2'}, {5, 5}, {10, 10}, false)});
  const SampleComparison t = Compare(cut, a).samples[0];
  EXPECT_EQ(t.first_diff_step, 2);
  EXPECT_EQ(t.token_a, -1);
  EXPECT_TRUE(std::isnan(t.margin_a));
  EXPECT_EQ(t.verdict, Verdict::kDivergence);
  // Either way round.
  const SampleComparison u = Compare(a, cut).samples[0];
  EXPECT_EQ(u.first_diff_step, 2);
  EXPECT_EQ(u.token_a, '7');
  EXPECT_EQ(u.token_b, -1);
  EXPECT_TRUE(std::isnan(u.margin_a));
  EXPECT_EQ(u.verdict, Verdict::kDivergence);
}

TEST(EvalCompareTest, NoiseIsMeasuredOnlyOverTheDecodeStepsBothRunsShare) {
  // Steps 1 and 2 are shared (the tokens before them agree); step 3 follows different tokens and
  // is not measured, however far apart; step 0 (the prefill's) is not a decode step.
  const json a = Doc("cpu", {Sample("vt", 7, "full", {'1', '2', '3', '4'}, {9, 1.0f, 0.02f, 5},
                                    {20, 10, 10, 10}, false)});
  const json b = Doc("cpu", {Sample("vt", 7, "full", {'1', '2', '5', '4'}, {1, 1.2f, 0.01f, 0},
                                    {0, 10.5f, 10, 0}, false)});
  const EvalComparison c = Compare(a, b);
  ASSERT_EQ(c.noise.size(), 1u);
  EXPECT_EQ(c.noise[0].policy, "full");
  EXPECT_EQ(c.noise[0].steps, 2);
  EXPECT_NEAR(c.noise[0].top_logit, 0.05, 1e-6);       // |10 - 10.5| / 10
  EXPECT_NEAR(c.noise[0].margin, 0.02, 1e-6);          // |1.0 - 1.2| / 10
  EXPECT_EQ(c.samples[0].verdict, Verdict::kNearTie);  // 0.02 <= 0.04 x 10
}

TEST(EvalCompareTest, SamplesArePairedByTaskContextSeedAndPolicy) {
  const json a = Doc("cpu", {Sample("vt", 7, "full", {'1'}, {1}, {1}, true),
                             Sample("vt", 8, "full", {'1'}, {1}, {1}, true),
                             Sample("vt", 7, "quest@0.05", {'1'}, {1}, {1}, true)});
  const json b = Doc("cuda", {Sample("vt", 7, "quest@0.05", {'1'}, {1}, {1}, true),
                              Sample("vt", 7, "full", {'1'}, {1}, {1}, true),
                              Sample("vt", 9, "full", {'1'}, {1}, {1}, true)});
  const EvalComparison c = Compare(a, b);
  EXPECT_EQ(c.samples.size(), 2u);
  EXPECT_EQ(c.identical, 2);
  ASSERT_EQ(c.only_a.size(), 1u);
  EXPECT_EQ(c.only_a[0].seed, 8u);
  ASSERT_EQ(c.only_b.size(), 1u);
  EXPECT_EQ(c.only_b[0].seed, 9u);
  const json out = ComparisonJson(c);
  EXPECT_EQ(out["paired"], 2);
  EXPECT_EQ(out["identical"], 2);
  EXPECT_EQ(out["only_in_a"].size(), 1u);
  EXPECT_EQ(out["differing"].size(), 0u);
}

TEST(EvalCompareTest, MalformedRunsAreRefusedNamingTheFileAndSample) {
  auto error = [](const json& doc) {
    absl::StatusOr<EvalRun> r = ParseEvalRun(doc, "X.json");
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(r.status().message());
  };
  // A results file of an older version: cells only.
  EXPECT_THAT(error(json{{"results", json::array()}}), HasSubstr("no per-sample records"));
  EXPECT_THAT(error(Doc("cpu", {Sample("vt", 7, "full", {'1', '2'}, {1}, {1, 1}, true)})),
              HasSubstr("2 tokens but 1 margins"));
  json bad_token = Doc("cpu", {Sample("vt", 7, "full", {'1'}, {1}, {1}, true)});
  bad_token["samples"][0]["tokens"][0] = "1";
  EXPECT_THAT(error(bad_token), HasSubstr("\"tokens\" holds a non-integer"));
  json no_seed = Doc("cpu", {Sample("vt", 7, "full", {'1'}, {1}, {1}, true)});
  no_seed["samples"][0].erase("seed");
  EXPECT_THAT(error(no_seed), HasSubstr("X.json sample 0"));
  EXPECT_THAT(error(Doc("cpu", {Sample("vt", 7, "full", {'1'}, {1}, {1}, true),
                                Sample("vt", 7, "full", {'2'}, {1}, {1}, true)})),
              HasSubstr("listed twice"));
  // A file without a device field is a CPU run (eval JSON written before --device).
  json old = Doc("cpu", {});
  old.erase("device");
  absl::StatusOr<EvalRun> r = ParseEvalRun(old, "old.json");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->device, "cpu");
}

TEST(EvalCompareTest, ASideMadeOfSeveralRunsIsTheirSamplesTogether) {
  auto run = [](const json& doc) { return *ParseEvalRun(doc, "x.json"); };
  const EvalRun k1 = run(Doc("cuda", {Sample("vt", 7, "full", {'1'}, {1}, {1}, true)}));
  const EvalRun k4 = run(Doc("cuda", {Sample("vt", 8, "full", {'1'}, {1}, {1}, true)}));
  absl::StatusOr<EvalRun> merged = MergeEvalRuns({k1, k4});
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->device, "cuda");
  EXPECT_EQ(merged->samples.size(), 2u);
  EXPECT_THAT(MergeEvalRuns({k1, k1}).status().message(), HasSubstr("in two files"));
  const EvalRun cpu = run(Doc("cpu", {Sample("vt", 9, "full", {'1'}, {1}, {1}, true)}));
  EXPECT_THAT(MergeEvalRuns({k1, cpu}).status().message(), HasSubstr("different devices"));
}

TEST(EvalCompareTest, TheCommandExitsOneOnADivergenceAndWritesItsJson) {
  const std::string dir = ::testing::TempDir() + "/eval_compare_test_" + std::to_string(getpid());
  ASSERT_EQ(system(("mkdir -p " + dir).c_str()), 0);
  auto write = [&](const std::string& name, const json& doc) {
    std::ofstream(dir + "/" + name) << doc.dump();
    return dir + "/" + name;
  };
  const std::string a =
      write("a.json", Doc("cpu", {Sample("vt", 7, "full", {'1', '2'}, {5, 3}, {10, 10}, true)}));
  const std::string same = write(
      "same.json", Doc("cuda", {Sample("vt", 7, "full", {'1', '2'}, {5, 3}, {10, 10}, true)}));
  const std::string other = write(
      "other.json", Doc("cuda", {Sample("vt", 7, "full", {'1', '3'}, {5, 1}, {10, 10}, false)}));
  EXPECT_EQ(RunEvalCompareCommand({a, same}), 0);
  const std::string out = dir + "/cmp.json";
  EXPECT_EQ(RunEvalCompareCommand({a, other, "--json", out}), 1);
  std::ifstream in(out);
  const json written = json::parse(in, nullptr, false);
  ASSERT_FALSE(written.is_discarded());
  EXPECT_EQ(written["divergences"], 1);
  ASSERT_EQ(written["differing"].size(), 1u);
  EXPECT_EQ(written["differing"][0]["verdict"], "divergence");
  EXPECT_EQ(written["differing"][0]["first_diff_step"], 1);
  // A side split over two files (one of them holding nothing of the other side) pairs the same.
  const std::string empty = write("empty.json", Doc("cuda", {}));
  EXPECT_EQ(RunEvalCompareCommand({a, same + "," + empty}), 0);
  EXPECT_EQ(RunEvalCompareCommand({a}), 2);                            // one file
  EXPECT_EQ(RunEvalCompareCommand({a, dir + "/missing.json"}), 1);     // unreadable
  EXPECT_EQ(RunEvalCompareCommand({a, same, "--near-tie", "-1"}), 2);  // bad flag value
  ASSERT_EQ(system(("rm -rf " + dir).c_str()), 0);
}

}  // namespace
}  // namespace fluxion::eval
