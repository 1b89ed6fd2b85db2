#include "cluster/trace.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#include "common/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

SyntheticOptions Synthetic(int64_t n, double rate, const std::string& input,
                           const std::string& output) {
  SyntheticOptions o;
  o.num_requests = n;
  o.rate = rate;
  o.input = *ParseLengthDistribution(input);
  o.output = *ParseLengthDistribution(output);
  return o;
}

using ::testing::HasSubstr;

// Writes `text` into the running test's own temp dir (tests run as parallel processes).
std::string WriteTemp(const ScopedTestTempDir& temp, const std::string& text) {
  std::string path = temp.File("trace.jsonl");
  std::ofstream(path) << text;
  return path;
}

TEST(TraceTest, LoadsMooncakeLinesSortedByTime) {
  ScopedTestTempDir temp;
  std::string path = WriteTemp(
      temp,
      "{\"timestamp\": 3000, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [0, 1]}\n"
      "\n"
      "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 7, \"hash_ids\": "
      "[0, 18446744073709551615]}\n");
  auto schedule = LoadMooncakeTrace(path);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  ASSERT_EQ(schedule->requests.size(), 2u);
  EXPECT_EQ(schedule->block_tokens, 512);
  EXPECT_EQ(schedule->requests[0].arrival_s, 0);
  EXPECT_EQ(schedule->requests[0].output_tokens, 7);
  EXPECT_EQ(schedule->requests[0].hash_ids[1], 18446744073709551615ULL);  // no 32-bit truncation
  EXPECT_EQ(schedule->requests[1].arrival_s, 3);
  EXPECT_EQ(schedule->requests[1].input_tokens, 1000);
}

TEST(TraceTest, MalformedLineIsInvalidArgumentNamingTheLine) {
  ScopedTestTempDir temp;
  std::string path = WriteTemp(
      temp,
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5}\n"
      "{\"timestamp\": 1, \"input_length\": \"ten\", \"output_length\": 5}\n");
  auto schedule = LoadMooncakeTrace(path);
  EXPECT_EQ(schedule.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(schedule.status().message().find(":2:"), std::string::npos) << schedule.status();
  EXPECT_EQ(LoadMooncakeTrace("/nonexistent.jsonl").status().code(), absl::StatusCode::kNotFound);
}

// Found by an attacker: an input_length of 10^10 passed and BuildPrompt died in bad_alloc.
TEST(TraceTest, LengthsAboveTheLimitAreInvalidArgumentNamingLineAndField) {
  ScopedTestTempDir temp;
  for (const char* field : {"input_length", "output_length"}) {
    std::string line = R"({"timestamp": 0, "input_length": 10, "output_length": 5})";
    const std::string key = absl::StrCat("\"", field, "\": ");
    const size_t at = line.find(key) + key.size();
    line.replace(at, line.find_first_of(",}", at) - at, "10000000000");
    std::string path = WriteTemp(temp, "{\"timestamp\": 0, \"input_length\": 1, "
                                       "\"output_length\": 1}\n" + line + "\n");
    auto schedule = LoadMooncakeTrace(path);
    EXPECT_EQ(schedule.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(std::string(schedule.status().message()), HasSubstr(":2:")) << field;
    EXPECT_THAT(std::string(schedule.status().message()), HasSubstr(field));
  }
}

TEST(TraceTest, RecordFieldsOutsideTheirRangeAreInvalidArgumentNamingTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"timestamp": -5, "input_length": 1, "output_length": 1})", "timestamp"},
      {R"({"timestamp": 1e300, "input_length": 1, "output_length": 1})", "timestamp"},
      {R"({"timestamp": 0, "input_length": 18446744073709551615, "output_length": 1})",
       "input_length"},
      {R"({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 2]})",
       "hash_ids"},
      {R"({"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [-1]})",
       "hash_ids"},
      {R"({"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [[[[[[[[[1]]]]]]]]]})",
       "nested"},
  };
  for (const auto& [line, field] : cases) {
    auto r = ParseMooncakeRecord(line, "t.jsonl:1");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << line;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(field)) << line;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("t.jsonl:1")) << line;
  }
}

TEST(TraceTest, OverlongLineIsInvalidArgumentInsteadOfBeingRead) {
  ScopedTestTempDir temp;
  std::string path = WriteTemp(temp, std::string(kMaxTraceLineBytes + 10, ' ') + "{}\n");
  auto schedule = LoadMooncakeTrace(path);
  EXPECT_EQ(schedule.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(schedule.status().message()), HasSubstr("longer than the limit"));
}

TEST(TraceTest, LastLineWithoutNewlineIsRead) {
  ScopedTestTempDir temp;
  std::string path = WriteTemp(temp,
                               "{\"timestamp\": 0, \"input_length\": 3, \"output_length\": 1}\n"
                               "{\"timestamp\": 1, \"input_length\": 4, \"output_length\": 2}");
  auto schedule = LoadMooncakeTrace(path);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  ASSERT_EQ(schedule->requests.size(), 2u);
  EXPECT_EQ(schedule->requests[1].input_tokens, 4);
}

// Found by an attacker: --input-len fixed:10000000000 aborted in bad_alloc.
TEST(TraceTest, LengthDistributionsAboveTheLimitAreRejected) {
  for (const char* text : {"fixed:10000000000", "uniform:1:10000000000", "normal:1e300:1",
                           "exponential:inf", "fixed:nan", "uniform:1.5:3", "normal:10:1e30"}) {
    EXPECT_EQ(ParseLengthDistribution(text).status().code(), absl::StatusCode::kInvalidArgument)
        << text;
  }
  EXPECT_TRUE(ParseLengthDistribution(absl::StrCat("fixed:", kMaxReplayTokens)).ok());
}

TEST(TraceTest, SyntheticSamplesStayWithinTheLimit) {
  SyntheticOptions o;
  o.num_requests = 200;
  o.input = *ParseLengthDistribution(absl::StrCat("exponential:", kMaxReplayTokens));
  o.output = *ParseLengthDistribution(absl::StrCat("normal:1:", kMaxReplayTokens));
  for (const TraceRequest& r : MakeSyntheticSchedule(o).requests) {
    EXPECT_GE(r.input_tokens, 1);
    EXPECT_LE(r.input_tokens, kMaxReplayTokens);
    EXPECT_GE(r.output_tokens, 1);
    EXPECT_LE(r.output_tokens, kMaxReplayTokens);
  }
}

// Found by an attacker: --num-requests 1000000000000 generated requests until memory ran out.
TEST(TraceTest, SyntheticOptionsOutsideTheLimitsNameTheFlag) {
  SyntheticOptions o;
  o.num_requests = 1000000000000;
  EXPECT_THAT(std::string(ValidateSyntheticOptions(o).message()), HasSubstr("--num-requests"));
  o.num_requests = 0;
  EXPECT_THAT(std::string(ValidateSyntheticOptions(o).message()), HasSubstr("--num-requests"));
  o.num_requests = 10;
  o.rate = -1;
  EXPECT_THAT(std::string(ValidateSyntheticOptions(o).message()), HasSubstr("--rate"));
  o.rate = 5;
  EXPECT_TRUE(ValidateSyntheticOptions(o).ok());
  o.distinct_prompts = -1;
  EXPECT_THAT(std::string(ValidateSyntheticOptions(o).message()), HasSubstr("--distinct-prompts"));
  o.distinct_prompts = 3;
  EXPECT_TRUE(ValidateSyntheticOptions(o).ok());
}

// --distinct-prompts: requests draw from a few prompts, each always with the same tokens and
// lengths, so their answers can be compared; without it every prompt is the request's own.
TEST(TraceTest, SyntheticRequestsShareOneOfTheDistinctPrompts) {
  SyntheticOptions o = Synthetic(200, 10, "uniform:8:64", "uniform:2:20");
  o.distinct_prompts = 5;
  Schedule s = MakeSyntheticSchedule(o);
  ASSERT_EQ(s.requests.size(), 200u);
  std::map<int64_t, std::pair<std::vector<uint32_t>, int64_t>> by_prompt;
  std::set<std::vector<uint32_t>> prompts;
  for (const TraceRequest& r : s.requests) {
    ASSERT_GE(r.source_index, 0);
    ASSERT_LT(r.source_index, 5);
    std::vector<uint32_t> tokens = BuildPrompt(r, s.block_tokens, 256);
    EXPECT_EQ(static_cast<int64_t>(tokens.size()), r.input_tokens);
    auto [it, first] = by_prompt.emplace(r.source_index, std::make_pair(tokens, r.output_tokens));
    if (!first) {
      EXPECT_EQ(it->second.first, tokens) << "prompt " << r.source_index;
      EXPECT_EQ(it->second.second, r.output_tokens) << "prompt " << r.source_index;
    }
    prompts.insert(tokens);
  }
  EXPECT_EQ(by_prompt.size(), 5u);  // the default seed's 200 picks cover all 5
  EXPECT_EQ(prompts.size(), 5u);
  o.distinct_prompts = 0;
  std::set<std::vector<uint32_t>> own;
  for (const TraceRequest& r : MakeSyntheticSchedule(o).requests) {
    own.insert(BuildPrompt(r, s.block_tokens, 256));
  }
  EXPECT_EQ(own.size(), 200u);
}

// Found by an attacker: a length scaled past int64 went through llround (undefined; INT64_MIN in
// practice) and max(1, .) silently made it a 1-token prompt.
TEST(TraceTest, ScaledLengthAboveTheLimitIsAnErrorNotAOneTokenPrompt) {
  Schedule s;
  s.requests.push_back(TraceRequest{0, 1000, 10, {}, 41});
  TraceTransform t;
  t.length_scale = 1e6;
  auto out = ApplyTransform(s, t, nullptr);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("42"));
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("--max-input-tokens"));
  // Capped, the same scale is fine.
  t.max_input_tokens = 5000;
  t.max_output_tokens = 100;
  out = ApplyTransform(s, t, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->requests[0].input_tokens, 5000);
  EXPECT_EQ(out->requests[0].output_tokens, 100);
}

TEST(TraceTest, TransformFlagsOutsideTheirRangeNameTheFlag) {
  const std::vector<std::pair<std::string, std::function<void(TraceTransform&)>>> cases = {
      {"--time-scale", [](TraceTransform& t) { t.time_scale = std::nan(""); }},
      {"--time-scale", [](TraceTransform& t) { t.time_scale = 1e300; }},
      {"--length-scale", [](TraceTransform& t) { t.length_scale = 0; }},
      {"--sample", [](TraceTransform& t) { t.sample_fraction = 2; }},
      {"--max-input-tokens", [](TraceTransform& t) { t.max_input_tokens = -1; }},
      {"--max-output-tokens", [](TraceTransform& t) { t.max_output_tokens = int64_t{1} << 40; }},
      {"--max-requests", [](TraceTransform& t) { t.max_requests = -3; }},
      {"--start-s", [](TraceTransform& t) { t.start_s = -1; }},
      {"--duration-s", [](TraceTransform& t) { t.duration_s = INFINITY; }},
  };
  for (const auto& [flag, set] : cases) {
    TraceTransform t;
    set(t);
    absl::Status s = ValidateTraceTransform(t);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_THAT(std::string(s.message()), HasSubstr(flag));
  }
  EXPECT_TRUE(ValidateTraceTransform(TraceTransform{}).ok());
}

TEST(TraceTest, BuildPromptWithADegenerateVocabularyDoesNotDivideByZero) {
  TraceRequest r{0, 8, 1, {3}, 0};
  for (uint32_t t : BuildPrompt(r, 4, 1)) EXPECT_EQ(t, 1u);
  EXPECT_EQ(BuildPrompt(r, 0, 2).size(), 8u);
}

TEST(TraceTest, SharedTracesLoadWhenPresent) {
  const char* root = std::getenv("FLUXION_SOURCE_DIR");
  std::string path = std::string(root ? root : ".") + "/../shared/traces/mooncake_synthetic_trace.jsonl";
  if (!std::ifstream(path)) GTEST_SKIP() << "no " << path;
  auto schedule = LoadMooncakeTrace(path);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  EXPECT_EQ(schedule->requests.size(), 3993u);
}

TEST(TraceTest, SharedHashIdsGiveSharedPrefixes) {
  TraceRequest a{0, 1200, 1, {7, 8, 9}, 0};
  TraceRequest b{0, 1100, 1, {7, 8, 10}, 1};
  std::vector<uint32_t> pa = BuildPrompt(a, 512, 256), pb = BuildPrompt(b, 512, 256);
  ASSERT_EQ(pa.size(), 1200u);
  ASSERT_EQ(pb.size(), 1100u);
  EXPECT_TRUE(std::equal(pa.begin(), pa.begin() + 1024, pb.begin()));
  int same_third_block = 0;
  for (int i = 1024; i < 1100; ++i) same_third_block += pa[i] == pb[i];
  EXPECT_LT(same_third_block, 10);
  for (uint32_t t : pa) {
    ASSERT_GE(t, 1u);
    ASSERT_LT(t, 256u);
  }
  EXPECT_EQ(BuildPrompt(a, 512, 256), pa);  // deterministic
}

TEST(TraceTest, TokensBeyondNamedBlocksAreUniquePerRequest) {
  TraceRequest a{0, 64, 1, {}, 0}, b{0, 64, 1, {}, 1};
  EXPECT_NE(BuildPrompt(a, 512, 32000), BuildPrompt(b, 512, 32000));
}

Schedule Uniform(int n) {
  Schedule s;
  for (int i = 0; i < n; ++i) s.requests.push_back({i * 1.0, 1000, 100, {1, 2}, i});
  return s;
}

TEST(TraceTest, TransformScalesTimeAndLengthsAndReportsCaps) {
  TraceTransform t;
  t.time_scale = 10;
  t.length_scale = 0.5;
  t.max_input_tokens = 400;
  t.max_output_tokens = 20;
  TransformReport report;
  auto out = ApplyTransform(Uniform(5), t, &report);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->block_tokens, 256);
  EXPECT_EQ(out->requests[3].arrival_s, 30);
  EXPECT_EQ(out->requests[3].input_tokens, 400);   // 500 after scaling, then capped
  EXPECT_EQ(out->requests[3].output_tokens, 20);   // 50 after scaling, then capped
  EXPECT_EQ(out->requests[3].hash_ids.size(), 2u);  // 400 tokens still span 2 blocks of 256
  EXPECT_EQ(report.inputs_capped, 5);
  EXPECT_EQ(report.outputs_capped, 5);
  EXPECT_EQ(report.span_in_s, 4);
  EXPECT_EQ(report.span_out_s, 40);
}

TEST(TraceTest, TransformWindowSubsampleAndLimitAreDeterministic) {
  TraceTransform t;
  t.start_s = 100;
  t.duration_s = 799;
  t.sample_fraction = 0.5;
  t.seed = 42;
  TransformReport report;
  auto a = ApplyTransform(Uniform(1000), t, &report);
  auto b = ApplyTransform(Uniform(1000), t, nullptr);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(report.requests_in, 1000);
  EXPECT_GT(report.requests_out, 340);  // ~400 of the 800 in the window
  EXPECT_LT(report.requests_out, 460);
  ASSERT_EQ(a->requests.size(), b->requests.size());
  for (size_t i = 0; i < a->requests.size(); ++i) {
    EXPECT_EQ(a->requests[i].source_index, b->requests[i].source_index);
  }
  EXPECT_EQ(a->requests.front().arrival_s, 0);  // re-based
  EXPECT_GE(a->requests.front().source_index, 100);
  t.max_requests = 7;
  EXPECT_EQ(ApplyTransform(Uniform(1000), t, nullptr)->requests.size(), 7u);
  t.time_scale = 0;
  EXPECT_EQ(ApplyTransform(Uniform(10), t, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TraceTest, SyntheticPoissonArrivalsHaveTheRequestedRate) {
  Schedule s = MakeSyntheticSchedule(Synthetic(4001, 20, "uniform:10:20", "fixed:5"));
  ASSERT_EQ(s.requests.size(), 4001u);
  double mean_gap = s.requests.back().arrival_s / 4000;
  EXPECT_NEAR(mean_gap, 0.05, 0.005);
  for (const TraceRequest& r : s.requests) {
    ASSERT_GE(r.input_tokens, 10);
    ASSERT_LE(r.input_tokens, 20);
    ASSERT_EQ(r.output_tokens, 5);
  }
}

TEST(TraceTest, LengthDistributionsParseOrExplain) {
  EXPECT_TRUE(ParseLengthDistribution("normal:100:10").ok());
  EXPECT_TRUE(ParseLengthDistribution("exponential:50").ok());
  EXPECT_FALSE(ParseLengthDistribution("uniform:10").ok());
  EXPECT_FALSE(ParseLengthDistribution("uniform:20:10").ok());
  EXPECT_FALSE(ParseLengthDistribution("zipf:1").ok());
  EXPECT_FALSE(ParseLengthDistribution("fixed:x").ok());
}

}  // namespace
}  // namespace fluxion::cluster
