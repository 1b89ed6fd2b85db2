#include "common/secret_token.h"

#include <set>

#include "gtest/gtest.h"

namespace fluxion {
namespace {

TEST(SecretTokenTest, TokensAreHexOfTheAskedLengthAndDistinct) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<std::string> t = RandomHexToken(16);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->size(), 32u);
    EXPECT_EQ(t->find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(*t);
  }
  EXPECT_EQ(seen.size(), 100u);  // 128-bit tokens: a repeat would be a broken generator
}

TEST(SecretTokenTest, EqualityNeedsTheWholeNonEmptyToken) {
  EXPECT_TRUE(TokensEqual("abcd", "abcd"));
  EXPECT_FALSE(TokensEqual("abcd", "abce"));
  EXPECT_FALSE(TokensEqual("abcd", "abc"));
  EXPECT_FALSE(TokensEqual("", ""));  // a missing token never matches
}

}  // namespace
}  // namespace fluxion
