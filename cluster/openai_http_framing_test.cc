#include "cluster/openai_http_framing.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::cluster::openai {
namespace {

using ::testing::HasSubstr;

TEST(FramingTest, OneWayToFindTheBodysEndOrRefused) {
  EXPECT_TRUE(CheckFraming({}).ok());
  EXPECT_TRUE(CheckFraming({{"12"}, {}}).ok());
  EXPECT_TRUE(CheckFraming({{"12", " 12"}, {}}).ok());  // the same length twice: allowed
  EXPECT_TRUE(CheckFraming({{}, {"chunked"}}).ok());
  EXPECT_TRUE(CheckFraming({{}, {" Chunked "}}).ok());

  absl::Status conflicting = CheckFraming({{"12", "40"}, {}});
  EXPECT_EQ(conflicting.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(conflicting.message(), HasSubstr("conflicting Content-Length"));
  for (const char* coding : {"chunked, identity", "gzip, chunked", "identity", ""}) {
    absl::Status s = CheckFraming({{}, {coding}});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << coding;
    EXPECT_THAT(s.message(), HasSubstr("only 'chunked'")) << coding;
  }
  EXPECT_FALSE(CheckFraming({{}, {"chunked", "chunked"}}).ok());
  absl::Status both = CheckFraming({{"12"}, {"chunked"}});
  EXPECT_EQ(both.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.message(), HasSubstr("both Content-Length and Transfer-Encoding"));
}

}  // namespace
}  // namespace fluxion::cluster::openai
