#include "bench/eval/task_codec.h"

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/byte_tokenizer.h"
#include "model/tokenizer.h"

namespace fluxion::eval {
namespace {

std::string ModelDir(const std::string& name) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(src ? src : ".") + "/tests/data/tokenizers/" + name;
}

// Llama 3's byte-level BPE (a test vocabulary): about four bytes of task text per token.
class TokenizerCodecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = model::LoadTokenizer(ModelDir("llama3"));
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = std::shared_ptr<const model::Tokenizer>(std::move(*t));
    newline_ = tokenizer_->Encode("\n").value().at(0);
  }
  std::shared_ptr<const model::Tokenizer> tokenizer_;
  int32_t newline_ = -1;
};

TEST_F(TokenizerCodecTest, SamplesHoldContextTokensOfTheModelsVocabulary) {
  const TaskCodec codec = TaskCodec::ForTokenizer(tokenizer_, /*bos=*/7, /*eos_ids=*/{9});
  for (const std::string task : {"niah_single", "vt", "passage"}) {
    for (int64_t context : {1024, 4096}) {
      const auto s = codec.Sample(task, context, kFirstCalibrationSeed);
      ASSERT_TRUE(s.ok()) << task << " " << context << ": " << s.status();
      const int64_t n = static_cast<int64_t>(s->prompt_ids.size());
      EXPECT_GE(10 * n, 9 * context) << task << " " << context;
      EXPECT_LE(n, context) << task << " " << context;
      EXPECT_EQ(s->context, context);
      EXPECT_EQ(s->prompt_ids[0], 7);
      // The ids are the tokenizer's of the text, which is longer than `context` bytes here.
      EXPECT_GT(static_cast<int64_t>(s->prompt_text.size()), context);
      EXPECT_EQ(tokenizer_->Decode(absl::MakeConstSpan(s->prompt_ids).subspan(1), false),
                s->prompt_text);
    }
  }
}

TEST_F(TokenizerCodecTest, AnswersEndAtANewlineTokenOrEos) {
  const TaskCodec codec = TaskCodec::ForTokenizer(tokenizer_, -1, {9});
  std::vector<int32_t> ids = tokenizer_->Encode("1234 5678").value();
  const size_t answer_tokens = ids.size();
  ids.push_back(newline_);
  ids.push_back(tokenizer_->Encode("junk").value().at(0));
  EXPECT_TRUE(codec.EndsAnswer(newline_));
  EXPECT_TRUE(codec.EndsAnswer(9));
  EXPECT_FALSE(codec.EndsAnswer(ids[0]));
  EXPECT_EQ(codec.AnswerText(ids), "1234 5678");
  ids[answer_tokens] = 9;
  EXPECT_EQ(codec.AnswerText(ids), "1234 5678");
  EXPECT_EQ(codec.MaxNewTokens("1234 5678"), static_cast<int64_t>(answer_tokens) + 16);
}

TEST(ByteCodecTest, IsTheByteTokenizersScoring) {
  const TaskCodec codec = TaskCodec::Bytes();
  const auto s = codec.Sample("niah_single", 1024, kFirstCalibrationSeed);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->prompt_ids, model::ByteTokenizer::Encode(s->prompt_text, /*add_bos=*/true));
  EXPECT_TRUE(codec.EndsAnswer('\n'));
  EXPECT_TRUE(codec.EndsAnswer(model::ByteTokenizer::kEos));
  EXPECT_EQ(codec.AnswerText(model::ByteTokenizer::Encode("42\nx", false)), "42");
  EXPECT_EQ(codec.MaxNewTokens("42"), 18);
}

}  // namespace
}  // namespace fluxion::eval
