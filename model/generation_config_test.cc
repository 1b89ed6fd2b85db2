#include "model/generation_config.h"

#include <fstream>
#include <string>

#include "common/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::model {
namespace {

using ::testing::HasSubstr;

TEST(GenerationConfigTest, ReadsTheSamplingDefaults) {
  // Llama-3.1-8B-Instruct's, as shipped.
  auto d = ParseGenerationConfig(R"({"bos_token_id": 128000, "do_sample": true,
      "eos_token_id": [128001, 128008, 128009], "temperature": 0.6, "top_p": 0.9,
      "transformers_version": "4.42.3"})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FLOAT_EQ(*d->temperature, 0.6f);
  EXPECT_FLOAT_EQ(*d->top_p, 0.9f);
  EXPECT_FALSE(d->top_k.has_value());
  EXPECT_FALSE(d->repetition_penalty.has_value());
  EXPECT_EQ(d->eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  auto greedy = ParseGenerationConfig(R"({"do_sample": false, "top_k": 20,
      "repetition_penalty": 1.05})");
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  EXPECT_EQ(*greedy->temperature, 0.0f);  // transformers decodes greedily without do_sample
  EXPECT_EQ(*greedy->top_k, 20u);
  auto one = ParseGenerationConfig(R"({"eos_token_id": 2})");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->eos_token_ids, (std::vector<int64_t>{2}));
  EXPECT_FLOAT_EQ(*greedy->repetition_penalty, 1.05f);
}

TEST(GenerationConfigTest, RefusesValuesNoSamplerTakesNamingTheField) {
  for (const auto& [text, field] : std::vector<std::pair<std::string, std::string>>{
           {R"({"temperature": -1})", "temperature"},
           {R"({"top_p": 0})", "top_p"},
           {R"({"top_k": 2.5})", "top_k"},
           {R"({"top_k": "5"})", "top_k"},
           {R"({"do_sample": 1})", "do_sample"},
           {R"({"eos_token_id": -1})", "eos_token_id"},
           {R"({"eos_token_id": [1, "2"]})", "eos_token_id"}}) {
    auto d = ParseGenerationConfig(text);
    ASSERT_FALSE(d.ok()) << text;
    EXPECT_THAT(d.status().message(), HasSubstr("'" + field + "'")) << text;
  }
  EXPECT_FALSE(ParseGenerationConfig("[1]").ok());
  EXPECT_FALSE(ParseGenerationConfig("{").ok());
}

TEST(GenerationConfigTest, AMissingFileGivesNoDefaultsAndABadOneNamesItsPath) {
  ScopedTestTempDir temp;
  const std::string dir = temp.dir();
  auto none = LoadGenerationConfig(dir);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->temperature.has_value());
  std::ofstream(dir + "/generation_config.json") << R"({"top_p": 2})";
  auto bad = LoadGenerationConfig(dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr(dir + "/generation_config.json"));
}

}  // namespace
}  // namespace fluxion::model
