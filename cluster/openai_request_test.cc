#include "cluster/openai_request.h"

#include <string>
#include <vector>

#include "cluster/openai_call.h"
#include "cluster/openai_generate.h"
#include "cluster/openai_response.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/tokenizer.h"

namespace fluxion::cluster::openai {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

absl::StatusOr<Request> Completions(const std::string& body) {
  return ParseRequest(Endpoint::kCompletions, body);
}
absl::StatusOr<Request> Chat(const std::string& body) {
  return ParseRequest(Endpoint::kChatCompletions, body);
}

// The field an error names and its message, checked together.
void ExpectRefused(const absl::StatusOr<Request>& r, const std::string& param,
                   const std::string& message_part) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrorParam(r.status()), param);
  EXPECT_THAT(r.status().message(), HasSubstr(message_part));
}

TEST(OpenAiRequestTest, CompletionFieldsMapOneToOne) {
  auto r = Completions(R"({"model":"m","prompt":"hi","max_tokens":7,"temperature":0.5,
      "top_p":0.9,"top_k":40,"seed":12,"stop":["a","bc"],"stop_token_ids":[257],"stream":true,
      "stream_options":{"include_usage":true},"user":"u1","n":1,"logprobs":null,
      "frequency_penalty":0,"presence_penalty":0})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model, "m");
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(*r->prompts[0].text, "hi");
  EXPECT_EQ(*r->max_tokens, 7u);
  EXPECT_FLOAT_EQ(*r->temperature, 0.5f);
  EXPECT_FLOAT_EQ(*r->top_p, 0.9f);
  EXPECT_EQ(*r->top_k, 40u);
  EXPECT_EQ(*r->seed, 12u);
  EXPECT_THAT(r->stop, ElementsAre("a", "bc"));
  EXPECT_THAT(r->stop_token_ids, ElementsAre(257u));
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
}

TEST(OpenAiRequestTest, CompletionDefaults) {
  auto r = Completions(R"({"model":"m","prompt":"hi","stop":"x"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->max_tokens, kDefaultCompletionMaxTokens);
  EXPECT_FALSE(r->temperature.has_value());
  EXPECT_FALSE(r->stream);
  EXPECT_THAT(r->stop, ElementsAre("x"));
}

TEST(OpenAiRequestTest, PromptAsTokenIds) {
  auto r = Completions(R"({"model":"m","prompt":[1,2,3]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_FALSE(r->prompts[0].text.has_value());
  EXPECT_THAT(r->prompts[0].ids, ElementsAre(1u, 2u, 3u));
  auto nested = Completions(R"({"model":"m","prompt":[[4,5]]})");
  ASSERT_TRUE(nested.ok()) << nested.status();
  ASSERT_EQ(nested->prompts.size(), 1u);
  EXPECT_THAT(nested->prompts[0].ids, ElementsAre(4u, 5u));
}

TEST(OpenAiRequestTest, SeveralPromptsAndNGiveOneChoiceEach) {
  auto r = Completions(R"({"model":"m","prompt":["a",[7,8]],"n":3})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 2u);
  EXPECT_EQ(*r->prompts[0].text, "a");
  EXPECT_THAT(r->prompts[1].ids, ElementsAre(7u, 8u));
  EXPECT_EQ(r->n, 3u);
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","n":0})"), "n", "[1, 128]");
  ExpectRefused(Completions(R"({"model":"m","prompt":["a","b"],"n":100})"), "n",
                "200 choices; at most 128");
  ExpectRefused(Completions(R"({"model":"m","prompt":["a",""]})"), "prompt", "empty");
  ExpectRefused(Completions(R"({"model":"m","prompt":[1,-2]})"), "prompt", "[0, 4294967295]");
  ExpectRefused(Completions(R"({"model":"m","prompt":""})"), "prompt", "empty");
}

TEST(OpenAiRequestTest, UnknownAndUnsupportedFieldsAreRefusedByName) {
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","bogus":1})"), "bogus",
                "Unrecognized request argument supplied: bogus");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","logit_bias":{"5":1}})"), "logit_bias",
                "logit biases");
  ExpectRefused(Chat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
      "tools":[]})"),
                "tools", "Unrecognized");
  // A chat-only field on completions.
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","messages":[]})"), "messages",
                "Unrecognized");
}

TEST(OpenAiRequestTest, LogprobsAndEchoAsCompletionsAndChatSpellThem) {
  absl::StatusOr<Request> c =
      Completions(R"({"model":"m","prompt":"p","logprobs":1,"echo":true})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->logprobs, std::optional<uint32_t>(1));
  EXPECT_TRUE(c->echo);
  c = Completions(R"({"model":"m","prompt":"p","logprobs":null})");
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->logprobs.has_value());
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","logprobs":21})"), "logprobs",
                "[0, 20]");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","echo":1})"), "echo", "boolean");

  const char* kUser = R"("model":"m","messages":[{"role":"user","content":"x"}])";
  absl::StatusOr<Request> chat =
      Chat(absl::StrCat("{", kUser, R"(,"logprobs":true,"top_logprobs":5})"));
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->logprobs, std::optional<uint32_t>(5));
  chat = Chat(absl::StrCat("{", kUser, R"(,"logprobs":true})"));
  ASSERT_TRUE(chat.ok());
  EXPECT_EQ(chat->logprobs, std::optional<uint32_t>(0));
  chat = Chat(absl::StrCat("{", kUser, R"(,"logprobs":false})"));
  ASSERT_TRUE(chat.ok());
  EXPECT_FALSE(chat->logprobs.has_value());
  ExpectRefused(Chat(absl::StrCat("{", kUser, R"(,"top_logprobs":2})")), "top_logprobs",
                "logprobs set to true");
  ExpectRefused(Chat(absl::StrCat("{", kUser, R"(,"logprobs":true,"top_logprobs":30})")),
                "top_logprobs", "[0, 20]");
  ExpectRefused(Chat(absl::StrCat("{", kUser, R"(,"echo":true})")), "echo", "Unrecognized");
}

TEST(OpenAiRequestTest, VllmAndFluxionExtensions) {
  auto r = Completions(R"({"model":"m","prompt":"p","ignore_eos":true,
      "include_stop_str_in_output":true,"skip_special_tokens":false,"min_tokens":0,
      "repetition_penalty":1,"fluxion":{"policy":"lfps","budget":0.05}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->ignore_eos);
  EXPECT_TRUE(r->include_stop_str_in_output);
  EXPECT_FALSE(r->skip_special_tokens);
  EXPECT_EQ(r->policy, "lfps");
  EXPECT_FLOAT_EQ(*r->budget, 0.05f);
  auto defaults = Completions(R"({"model":"m","prompt":"p"})");
  ASSERT_TRUE(defaults.ok());
  EXPECT_FALSE(defaults->ignore_eos);
  EXPECT_TRUE(defaults->skip_special_tokens);
  EXPECT_TRUE(defaults->policy.empty());
  EXPECT_FALSE(defaults->budget.has_value());
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","ignore_eos":1})"), "ignore_eos",
                "boolean");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","fluxion":{"budget":0}})"), "fluxion",
                "(0, 1]");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","fluxion":{"policy":""}})"), "fluxion",
                "policy name");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","fluxion":{"budgets":1}})"), "fluxion",
                "fluxion.budgets is not supported");
}

TEST(OpenAiRequestTest, PenaltiesAndMinTokens) {
  absl::StatusOr<Request> r = Completions(
      R"({"model":"m","prompt":"p","presence_penalty":0.5,"frequency_penalty":-1,
          "repetition_penalty":1.2,"min_tokens":4,"max_tokens":8})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FLOAT_EQ(r->presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r->frequency_penalty, -1.0f);
  EXPECT_EQ(r->repetition_penalty, std::optional<float>(1.2f));
  EXPECT_EQ(r->min_tokens, 4u);
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","presence_penalty":2.5})"),
                "presence_penalty", "[-2, 2]");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","frequency_penalty":"x"})"),
                "frequency_penalty", "number");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","repetition_penalty":0})"),
                "repetition_penalty", "> 0");
  // Completions' default max_tokens is 16.
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","min_tokens":17})"), "min_tokens",
                "at most max_tokens (16)");
}

TEST(OpenAiRequestTest, ValuesOutOfRange) {
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","max_tokens":0})"), "max_tokens", "[1, ");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","max_tokens":"5"})"), "max_tokens",
                "integer");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","temperature":-1})"), "temperature",
                ">= 0");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","top_p":0})"), "top_p", "(0, 1]");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","seed":-3})"), "seed", "[0, ");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","stop":[""]})"), "stop", "empty");
  ExpectRefused(Completions(R"({"model":"m","prompt":"p","stop":[1]})"), "stop", "strings");
  ExpectRefused(
      Completions(R"({"model":"m","prompt":"p","stream_options":{"include_usage":true}})"),
      "stream_options", "only allowed when stream");
  ExpectRefused(Completions(R"({"prompt":"p"})"), "model", "required");
  ExpectRefused(Completions(R"({"model":"m"})"), "prompt", "required");
}

TEST(OpenAiRequestTest, BadBodies) {
  for (const std::string& body :
       std::vector<std::string>{"", "[1]", "{\"model\":", "{\"model\":\"m\",\"model\":\"n\"}",
                                std::string(100, '[') + std::string(100, ']')}) {
    auto r = Completions(body);
    EXPECT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << body;
  }
  // Not UTF-8 inside a string.
  auto r = Completions("{\"model\":\"m\",\"prompt\":\"\xff\xfe\"}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpenAiRequestTest, ChatMessages) {
  auto r = Chat(R"({"model":"m","messages":[{"role":"system","content":"be brief"},
      {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
      "max_completion_tokens":9})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->messages.size(), 2u);
  EXPECT_EQ(r->messages[0].role, "system");
  EXPECT_EQ(r->messages[1].content, "ab");
  EXPECT_EQ(*r->max_tokens, 9u);
  auto unlimited = Chat(R"({"model":"m","messages":[{"role":"user","content":"x"}]})");
  ASSERT_TRUE(unlimited.ok());
  EXPECT_FALSE(unlimited->max_tokens.has_value());  // the context's room, not 16
  // OpenAI's `developer` role is the templates' `system`; a name goes to the template.
  auto developer = Chat(R"({"model":"m","messages":[{"role":"developer","content":"d"},
      {"role":"user","content":"x","name":"ann"}],"chat_template_kwargs":{"enable_thinking":false}})");
  ASSERT_TRUE(developer.ok()) << developer.status();
  EXPECT_EQ(developer->messages[0].role, "system");
  EXPECT_EQ(developer->messages[1].name, "ann");
  EXPECT_EQ(developer->chat_template_kwargs, nlohmann::json({{"enable_thinking", false}}));
  ExpectRefused(Chat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
      "chat_template_kwargs":[1]})"),
                "chat_template_kwargs", "must be an object");
  ExpectRefused(Chat(R"({"model":"m","messages":[{"role":"user","content":"x","name":3}]})"),
                "messages", "name must be a string");
  ExpectRefused(Chat(R"({"model":"m","messages":[]})"), "messages", "non-empty");
  ExpectRefused(Chat(R"({"model":"m","messages":[{"role":"user"}]})"), "messages", "no content");
  ExpectRefused(Chat(R"({"model":"m","messages":[{"role":"user","content":"x","tool_calls":[]}]})"),
                "messages", "tool_calls is not supported");
  ExpectRefused(
      Chat(R"({"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]})"),
      "messages", "text");
  ExpectRefused(Chat(R"({"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":3,
      "max_completion_tokens":4})"),
                "max_completion_tokens", "differ");
}

TEST(OpenAiGenerateTest, MapsOntoGenerateRequest) {
  auto tokenizer = model::NewByteTokenizer();
  auto r = Completions(R"({"model":"m","prompt":"ab","max_tokens":5,"temperature":0,
      "seed":3,"stop_token_ids":[257]})");
  ASSERT_TRUE(r.ok());
  auto choices = PrepareGenerate(*r, *tokenizer, nullptr, "cmpl-1");
  ASSERT_TRUE(choices.ok()) << choices.status();
  ASSERT_EQ(choices->size(), 1u);
  const v1::GenerateRequest* g = &(*choices)[0].generate;
  EXPECT_EQ(g->request_id(), "cmpl-1");
  EXPECT_THAT(g->prompt_token_ids(), ElementsAre('a', 'b'));
  EXPECT_EQ(g->sampling().max_tokens(), 5u);
  EXPECT_EQ(g->sampling().temperature(), 0.f);
  EXPECT_TRUE(g->sampling().has_temperature());
  EXPECT_FALSE(g->sampling().has_top_p());
  EXPECT_EQ(g->sampling().seed(), 3u);
  EXPECT_THAT(g->sampling().stop_token_ids(), ElementsAre(257u));
  EXPECT_FALSE(g->sampling().ignore_eos());
  EXPECT_FALSE(g->has_sparse());  // the decode node's default policy
  auto ext = Completions(R"({"model":"m","prompt":"ab","ignore_eos":true,
      "fluxion":{"policy":"quest","budget":0.1}})");
  ASSERT_TRUE(ext.ok());
  auto prepared = PrepareGenerate(*ext, *tokenizer, nullptr, "cmpl-2");
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  const v1::GenerateRequest* with = &(*prepared)[0].generate;
  EXPECT_TRUE(with->sampling().ignore_eos());
  EXPECT_EQ(with->sparse().policy(), "quest");
  EXPECT_FLOAT_EQ(with->sparse().budget(), 0.1f);
}

TEST(OpenAiGenerateTest, OneCallPerChoiceInVllmsOrderWithDistinctSeeds) {
  auto tokenizer = model::NewByteTokenizer();
  auto r = Completions(R"({"model":"m","prompt":["ab","c"],"n":2,"seed":10})");
  ASSERT_TRUE(r.ok()) << r.status();
  auto choices = PrepareGenerate(*r, *tokenizer, nullptr, "cmpl-9");
  ASSERT_TRUE(choices.ok()) << choices.status();
  ASSERT_EQ(choices->size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const PreparedChoice& c = (*choices)[i];
    EXPECT_EQ(c.prompt, i / 2);
    EXPECT_EQ(c.generate.request_id(), "cmpl-9." + std::to_string(i));
    EXPECT_EQ(c.generate.sampling().seed(), 10u + i % 2);
    EXPECT_EQ(c.generate.prompt_token_ids_size(), i < 2 ? 2 : 1);
  }
  // Unseeded choices stay unseeded (the servers pick each one's stream).
  auto unseeded = Completions(R"({"model":"m","prompt":"ab","n":2})");
  auto two = PrepareGenerate(*unseeded, *tokenizer, nullptr, "x");
  ASSERT_TRUE(two.ok());
  EXPECT_FALSE((*two)[1].generate.sampling().has_seed());
}

// generation_config.json's defaults fill what a request leaves unset, never what it sets.
TEST(OpenAiGenerateTest, UnsetSamplingFieldsTakeTheModelsGenerationDefaults) {
  auto tokenizer = model::NewByteTokenizer();
  ChatRenderer chat;
  Preparer preparer;
  preparer.tokenizer = tokenizer.get();
  preparer.chat = &chat;
  preparer.model_name = "m";
  preparer.generation_defaults.temperature = 0.6f;
  preparer.generation_defaults.top_p = 0.9f;
  preparer.generation_defaults.top_k = 20;
  const model::EncodeCheck go = [] { return absl::OkStatus(); };
  auto unset = Prepare(preparer, Endpoint::kCompletions, R"({"model":"m","prompt":"a"})", "x", go);
  ASSERT_TRUE(unset.ok()) << unset.status();
  const v1::SamplingParams& s = unset->choices[0].generate.sampling();
  EXPECT_FLOAT_EQ(s.temperature(), 0.6f);
  EXPECT_FLOAT_EQ(s.top_p(), 0.9f);
  EXPECT_EQ(s.top_k(), 20u);
  auto set = Prepare(preparer, Endpoint::kCompletions,
                     R"({"model":"m","prompt":"a","temperature":0,"top_p":1,"top_k":-1})", "x", go);
  ASSERT_TRUE(set.ok()) << set.status();
  const v1::SamplingParams& own = set->choices[0].generate.sampling();
  EXPECT_EQ(own.temperature(), 0.f);
  EXPECT_EQ(own.top_p(), 1.f);
  EXPECT_EQ(own.top_k(), 0u);
}

TEST(OpenAiGenerateTest, RefusesWhatExceedsTheContextInOpenAisWording) {
  auto tokenizer = model::NewByteTokenizer();
  auto r = Completions(R"({"model":"m","prompt":"abcdef","max_tokens":5})");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(PrepareGenerate(*r, *tokenizer, nullptr, "x", {}, 11).ok()) << "6 + 5 fit 11";
  auto over = PrepareGenerate(*r, *tokenizer, nullptr, "x", {}, 10);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(over.status().message(),
            "This model's maximum context length is 10 tokens. However, you requested 11 tokens "
            "(6 in the prompt, 5 in the completion). Please reduce the length of the prompt or "
            "completion.");
  EXPECT_EQ(ErrorParam(over.status()), "prompt");
  const ApiError e = ErrorFromStatus(over.status());
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.code, "context_length_exceeded");
  // A prompt that leaves no room, in chat.
  const absl::Status chat = CheckContextLength(Endpoint::kChatCompletions, 6, std::nullopt, 6);
  EXPECT_EQ(chat.message(),
            "This model's maximum context length is 6 tokens. However, your messages resulted in "
            "6 tokens. Please reduce the length of the messages.");
  EXPECT_EQ(ErrorParam(chat), "messages");
  EXPECT_TRUE(CheckContextLength(Endpoint::kChatCompletions, 5, std::nullopt, 6).ok());
}

TEST(OpenAiGenerateTest, RefusesIdsOutsideTheVocabularyAndChatWithoutTemplate) {
  auto tokenizer = model::NewByteTokenizer();
  auto ids = Completions(R"({"model":"m","prompt":[1,100000]})");
  ASSERT_TRUE(ids.ok());
  auto g = PrepareGenerate(*ids, *tokenizer, nullptr, "x");
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(ErrorParam(g.status()), "prompt");
  auto stop = Completions(R"({"model":"m","prompt":"a","stop_token_ids":[999999]})");
  ASSERT_TRUE(stop.ok());
  EXPECT_EQ(ErrorParam(PrepareGenerate(*stop, *tokenizer, nullptr, "x").status()),
            "stop_token_ids");
  auto chat = Chat(R"({"model":"m","messages":[{"role":"user","content":"x"}]})");
  ASSERT_TRUE(chat.ok());
  auto none = PrepareGenerate(*chat, *tokenizer, nullptr, "x");
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("no chat template"));
  ChatRenderer render = [](const std::vector<Message>& m,
                           const nlohmann::json& kwargs) -> absl::StatusOr<std::string> {
    return "<" + m[0].role + ">" + m[0].content + kwargs.value("suffix", "");
  };
  auto rendered = PrepareGenerate(*chat, *tokenizer, render, "x");
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  EXPECT_EQ((*rendered)[0].generate.prompt_token_ids_size(), 7);  // "<user>x"
  // The request's chat_template_kwargs reach the renderer.
  auto with_kwargs = Chat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
      "chat_template_kwargs":{"suffix":"yz"}})");
  ASSERT_TRUE(with_kwargs.ok());
  auto suffixed = PrepareGenerate(*with_kwargs, *tokenizer, render, "x");
  ASSERT_TRUE(suffixed.ok()) << suffixed.status();
  EXPECT_EQ((*suffixed)[0].generate.prompt_token_ids_size(), 9);  // "<user>xyz"
}

}  // namespace
}  // namespace fluxion::cluster::openai
