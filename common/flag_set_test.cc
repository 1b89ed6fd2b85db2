#include "common/flag_set.h"

#include "gtest/gtest.h"

namespace fluxion {
namespace {

TEST(FlagSetTest, ParsesEveryKindOfFlag) {
  std::string model;
  int64_t max_tokens = 16;
  double temperature = 0.0;
  bool ignore_eos = false;
  std::vector<int64_t> contexts;
  FlagSet flags("fluxion test", "testing");
  flags.String("model", &model, "model dir");
  flags.Int("max-tokens", &max_tokens, "n");
  flags.Double("temperature", &temperature, "t");
  flags.Bool("ignore-eos", &ignore_eos, "b");
  flags.IntList("contexts", &contexts, "list");
  ASSERT_TRUE(flags
                  .Parse({"--model", "/m", "--max-tokens=5", "--temperature", "0.5", "--ignore-eos",
                          "--contexts", "4096,131072"})
                  .ok());
  EXPECT_EQ(model, "/m");
  EXPECT_EQ(max_tokens, 5);
  EXPECT_DOUBLE_EQ(temperature, 0.5);
  EXPECT_TRUE(ignore_eos);
  EXPECT_EQ(contexts, (std::vector<int64_t>{4096, 131072}));
  EXPECT_TRUE(flags.WasSet("model"));
}

TEST(FlagSetTest, NegatedBoolTurnsFlagOff) {
  bool b = true;
  FlagSet flags("x", "y");
  flags.Bool("json", &b, "");
  ASSERT_TRUE(flags.Parse({"--nojson"}).ok());
  EXPECT_FALSE(b);
}

TEST(FlagSetTest, UnknownFlagIsRejectedByName) {
  FlagSet flags("fluxion generate", "y");
  absl::Status s = flags.Parse({"--bogus", "1"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--bogus"), std::string::npos);
}

TEST(FlagSetTest, BadNumberIsRejectedWithValue) {
  int64_t n = 0;
  FlagSet flags("x", "y");
  flags.Int("n", &n, "");
  absl::Status s = flags.Parse({"--n", "12a"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("12a"), std::string::npos);
}

TEST(FlagSetTest, MissingValueAndMissingRequiredFlagAreErrors) {
  std::string m;
  FlagSet flags("x", "y");
  flags.String("model", &m, "");
  flags.Require("model");
  EXPECT_FALSE(flags.Parse({"--model"}).ok());
  FlagSet flags2("x", "y");
  flags2.String("model", &m, "");
  flags2.Require("model");
  absl::Status s = flags2.Parse({});
  EXPECT_NE(s.message().find("--model"), std::string::npos);
}

TEST(FlagSetTest, HelpSkipsRequiredCheckAndUsageListsFlags) {
  std::string m;
  FlagSet flags("fluxion generate", "Generates tokens.");
  flags.String("model", &m, "model directory");
  flags.Require("model");
  ASSERT_TRUE(flags.Parse({"--help"}).ok());
  EXPECT_TRUE(flags.help_requested());
  EXPECT_NE(flags.Usage().find("--model VALUE"), std::string::npos);
}

TEST(FlagSetTest, EmptyListIsRejected) {
  std::vector<double> v;
  FlagSet flags("x", "y");
  flags.DoubleList("budget", &v, "");
  EXPECT_FALSE(flags.Parse({"--budget", ","}).ok());
}

}  // namespace
}  // namespace fluxion
