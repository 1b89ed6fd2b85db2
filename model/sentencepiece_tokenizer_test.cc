// SentencePieceTokenizer over a small model trained here with libsentencepiece_train (BPE with
// byte fallback, as Llama 2's): LoadTokenizer's choice, ids round-tripping to the text, control
// pieces written in the text, bytes of unseen characters, the specials, the lookups.
#include "model/sentencepiece_tokenizer.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/sentencepiece_train_testing.h"
#include "model/tokenizer.h"

namespace fluxion::model {
namespace {

class SentencePieceTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string corpus = temp_.File("corpus.txt");
    {
      std::ofstream out(corpus);
      const char* words[] = {"hello", "world", "the", "river", "flows", "to", "sea",
                             "green", "grass", "sky", "blue", "key", "is", "number"};
      for (int line = 0; line < 300; ++line) {
        for (int w = 0; w < 8; ++w) out << (w ? " " : "") << words[(line * 7 + w * 3) % 14];
        out << "\n";
      }
    }
    std::string error;
    ASSERT_TRUE(TrainSentencePieceForTesting(
        corpus, "--vocab_size=320 --model_type=bpe --byte_fallback=true", &model_, &error))
        << error;
    std::ofstream(temp_.File("tokenizer.model"), std::ios::binary) << model_;
    auto loaded = LoadTokenizer(temp_.dir());
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    tokenizer_ = *std::move(loaded);
  }

  std::vector<int32_t> Encode(const std::string& text) {
    auto ids = tokenizer_->Encode(text);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<int32_t>{};
  }

  ScopedTestTempDir temp_;
  std::string model_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(SentencePieceTokenizerTest, LoadTokenizerPicksTheModelAndIdsRoundTrip) {
  ASSERT_NE(dynamic_cast<SentencePieceTokenizer*>(tokenizer_.get()), nullptr);
  EXPECT_EQ(tokenizer_->vocab_size(), 320);
  const std::vector<int32_t> ids = Encode("hello world the river");
  EXPECT_LT(ids.size(), 12u);  // merged pieces, not characters
  // The dummy prefix: the first word's piece carries the space mark, as SentencePiece adds it.
  EXPECT_EQ(tokenizer_->Decode(ids, /*skip_special=*/true), " hello world the river");
}

// A tokenizer.json HfTokenizer cannot read (as one converted from a SentencePiece model) beside
// tokenizer.model: the model is used; without tokenizer.model its error is the answer.
TEST_F(SentencePieceTokenizerTest, AnUnreadableTokenizerJsonDefersToTheModel) {
  std::ofstream(temp_.File("tokenizer.json")) << R"({"model": {"type": "Unigram"}})";
  auto loaded = LoadTokenizer(temp_.dir());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_NE(dynamic_cast<SentencePieceTokenizer*>(loaded->get()), nullptr);
  std::remove(temp_.File("tokenizer.model").c_str());
  EXPECT_FALSE(LoadTokenizer(temp_.dir()).ok());
}

TEST_F(SentencePieceTokenizerTest, UnseenCharactersFallBackToTheirBytes) {
  const std::vector<int32_t> ids = Encode("sky \xf0\x9f\x98\x80 blue");  // an emoji never seen
  EXPECT_EQ(tokenizer_->Decode(ids, true), " sky \xf0\x9f\x98\x80 blue");
  int bytes = 0;
  for (int32_t id : ids) bytes += tokenizer_->IdToToken(id)->rfind("<0x", 0) == 0;
  EXPECT_EQ(bytes, 4);
}

TEST_F(SentencePieceTokenizerTest, ControlPiecesWrittenInTheTextAreMatchedAndSpecial) {
  const std::optional<int32_t> bos = tokenizer_->TokenToId("<s>");
  const std::optional<int32_t> eos = tokenizer_->TokenToId("</s>");
  ASSERT_TRUE(bos.has_value() && eos.has_value());
  EXPECT_TRUE(tokenizer_->IsSpecial(*bos));
  EXPECT_TRUE(tokenizer_->IsSpecial(*eos));
  const std::vector<int32_t> ids = Encode("<s>hello</s>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), *bos);
  EXPECT_EQ(ids.back(), *eos);
  EXPECT_EQ(tokenizer_->Decode(ids, /*skip_special=*/true), " hello");
  EXPECT_EQ(tokenizer_->Decode(ids, /*skip_special=*/false), "<s> hello</s>");
  EXPECT_FALSE(tokenizer_->IsSpecial(ids[1]));
}

TEST_F(SentencePieceTokenizerTest, LookupsAndBadInput) {
  EXPECT_FALSE(tokenizer_->TokenToId("no such piece").has_value());
  EXPECT_FALSE(tokenizer_->IdToToken(-1).has_value());
  EXPECT_FALSE(tokenizer_->IdToToken(320).has_value());
  EXPECT_FALSE(tokenizer_->Encode("\xff").ok());  // not UTF-8
  EXPECT_FALSE(SentencePieceTokenizer::FromBytes("not a model", "x").ok());
  // A check that fails stops the encoding with its status.
  auto stopped = tokenizer_->EncodeChecked(
      "hello", [] { return absl::DeadlineExceededError("too slow"); });
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace fluxion::model
