#include "cluster/openai_tokenize.h"

#include <string>
#include <vector>

#include "cluster/openai_request.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster::openai {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

class TokenizeTest : public ::testing::Test {
 protected:
  TokenizeTest() {
    chat_ = [](const std::vector<Message>& messages,
               const nlohmann::json&) -> absl::StatusOr<std::string> {
      std::string out;
      for (const Message& m : messages) out += m.role + ": " + m.content + "\n";
      return out + "assistant: ";
    };
    preparer_.tokenizer = tokenizer_.get();
    preparer_.chat = &chat_;
    preparer_.model_name = "tiny";
    preparer_.max_context_tokens = 4096;
  }

  absl::StatusOr<Json> Tokenize(const std::string& body) {
    auto answer = TokenizeAnswer(preparer_, body, [] { return absl::OkStatus(); });
    if (!answer.ok()) return answer.status();
    return Json::parse(*answer);
  }

  std::unique_ptr<model::Tokenizer> tokenizer_ = model::NewByteTokenizer();
  ChatRenderer chat_;
  Preparer preparer_;
};

TEST_F(TokenizeTest, APromptCountsAsTheCompletionsEndpointTokenizesIt) {
  auto j = Tokenize(R"({"model":"tiny","prompt":"ab"})");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["count"], 2);
  EXPECT_EQ((*j)["tokens"], Json::array({'a', 'b'}));
  EXPECT_EQ((*j)["max_model_len"], 4096);
  EXPECT_TRUE((*j)["token_strs"].is_null());
}

TEST_F(TokenizeTest, MessagesGoThroughTheChatTemplate) {
  auto j = Tokenize(R"({"messages":[{"role":"user","content":"hi"}]})");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["count"], std::string("user: hi\nassistant: ").size());
}

TEST_F(TokenizeTest, RefusesWhatItCannotHonourByName) {
  auto expect = [&](const std::string& body, const std::string& param, const std::string& part) {
    auto j = Tokenize(body);
    ASSERT_FALSE(j.ok()) << body;
    EXPECT_EQ(ErrorParam(j.status()), param) << body;
    EXPECT_THAT(j.status().message(), HasSubstr(part)) << body;
  };
  expect(R"({"prompt":"a","add_special_tokens":true})", "add_special_tokens", "nothing added");
  expect(R"({"prompt":"a","messages":[]})", "prompt", "exactly one");
  expect(R"({"prompt":"a","bogus":1})", "bogus", "Unrecognized");
  expect(R"({"model":"other","prompt":"a"})", "model", "does not exist");
  expect(R"({"prompt":""})", "prompt", "empty");
  EXPECT_TRUE(Tokenize(R"({"prompt":"a","add_special_tokens":false})").ok());
}

TEST_F(TokenizeTest, DetokenizeWritesTheTextOfIdsInTheVocabulary) {
  auto answer = DetokenizeAnswer(preparer_, R"({"model":"tiny","tokens":[104,105]})");
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(Json::parse(*answer)["prompt"], "hi");
  auto outside = DetokenizeAnswer(preparer_, R"({"tokens":[1000000]})");
  ASSERT_FALSE(outside.ok());
  EXPECT_EQ(ErrorParam(outside.status()), "tokens");
  EXPECT_FALSE(DetokenizeAnswer(preparer_, R"({"tokens":"x"})").ok());
  EXPECT_FALSE(DetokenizeAnswer(preparer_, R"({})").ok());
  EXPECT_FALSE(DetokenizeAnswer(preparer_, R"({"tokens":[-1]})").ok());
}

}  // namespace
}  // namespace fluxion::cluster::openai
