#include "model/byte_tokenizer.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::model {
namespace {

using ::testing::ElementsAre;

TEST(ByteTokenizerTest, EncodesEachByteAsItsValue) {
  EXPECT_THAT(ByteTokenizer::Encode("Hi 7\n", /*add_bos=*/false), ElementsAre(72, 105, 32, 55, 10));
}

TEST(ByteTokenizerTest, PrependsBosOnlyWhenAsked) {
  EXPECT_THAT(ByteTokenizer::Encode("a", /*add_bos=*/true), ElementsAre(ByteTokenizer::kBos, 97));
  EXPECT_THAT(ByteTokenizer::Encode("", /*add_bos=*/true), ElementsAre(ByteTokenizer::kBos));
  EXPECT_TRUE(ByteTokenizer::Encode("", /*add_bos=*/false).empty());
}

TEST(ByteTokenizerTest, MapsHighBytesToIdsAbove127NotNegative) {
  const std::string text = "\xc3\xa9\xff";
  EXPECT_THAT(ByteTokenizer::Encode(text, false), ElementsAre(0xc3, 0xa9, 0xff));
}

TEST(ByteTokenizerTest, RoundTripsEveryByte) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(ByteTokenizer::Decode(ByteTokenizer::Encode(all, false)), all);
}

TEST(ByteTokenizerTest, WritesSpecialsAndUnknownIdsVisibly) {
  const std::vector<int32_t> ids = {ByteTokenizer::kBos, 'o', 'k', ByteTokenizer::kEos,
                                    ByteTokenizer::kPad, 259, 1000, -3};
  EXPECT_EQ(ByteTokenizer::Decode(ids), "<bos>ok<eos><pad><unk:259><unk:1000><unk:-3>");
}

TEST(ByteTokenizerTest, SpecialIdsAreTheOnesTasksMdFixes) {
  EXPECT_EQ(ByteTokenizer::kBos, 256);
  EXPECT_EQ(ByteTokenizer::kEos, 257);
  EXPECT_EQ(ByteTokenizer::kPad, 258);
  EXPECT_EQ(ByteTokenizer::kVocabSize, 264);
}

}  // namespace
}  // namespace fluxion::model
