#include "cluster/openai_response.h"

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster::openai {
namespace {

using Json = nlohmann::json;

// The JSON of one "data: ...\n\n" event.
Json EventJson(const std::string& event) {
  EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
  EXPECT_EQ(event.substr(event.size() - 2), "\n\n") << event;
  return Json::parse(event.substr(6, event.size() - 8));
}

TEST(OpenAiResponseTest, ErrorShapeAndHttpStatus) {
  ApiError e = ErrorFromStatus(WithParam(absl::InvalidArgumentError("bad n"), "n"));
  EXPECT_EQ(e.http_status, 400);
  Json j = Json::parse(ErrorJson(e));
  EXPECT_EQ(j["error"]["message"], "bad n");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "n");
  EXPECT_TRUE(j["error"]["code"].is_null());
  EXPECT_EQ(ErrorFromStatus(absl::ResourceExhaustedError("full")).http_status, 429);
  EXPECT_EQ(ErrorFromStatus(absl::ResourceExhaustedError("full")).retry_after_s, 1);
  EXPECT_EQ(ErrorFromStatus(absl::UnavailableError("none")).http_status, 503);
  EXPECT_EQ(ErrorFromStatus(absl::UnavailableError("none")).retry_after_s, 1);
  EXPECT_EQ(ErrorFromStatus(absl::DeadlineExceededError("slow")).http_status, 504);
  EXPECT_EQ(ErrorFromStatus(absl::InternalError("bug")).http_status, 500);
  EXPECT_TRUE(Json::parse(ErrorJson(ErrorFromStatus(absl::InternalError("x"))))["error"]["param"]
                  .is_null());
}

TEST(OpenAiResponseTest, WholeCompletionAndChat) {
  ResponseMeta meta{Endpoint::kCompletions, "cmpl-1", 100, "m"};
  ChoiceEnd length{"length"};
  length.policy = "fluxion";
  length.read_fraction = 0.25f;
  Json c = Json::parse(CompletionJson(meta, {{"héllo", length}}, {3, 4}));
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], "héllo");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(c["choices"][0]["stop_reason"].is_null());
  EXPECT_EQ(c["fluxion"]["policy"], "fluxion");
  EXPECT_EQ(c["fluxion"]["read_fraction"], 0.25);
  EXPECT_EQ(c["usage"]["total_tokens"], 7);
  meta.endpoint = Endpoint::kChatCompletions;
  ChoiceEnd stop{"stop"};
  stop.stop_token_id = 7;
  Json chat = Json::parse(CompletionJson(meta, {{"hi", stop}, {"ho", length}}, {1, 2}));
  ASSERT_EQ(chat["choices"].size(), 2u);
  EXPECT_EQ(chat["choices"][1]["index"], 1);
  EXPECT_EQ(chat["choices"][1]["message"]["content"], "ho");
  EXPECT_EQ(chat["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(chat["choices"][0]["stop_reason"], 7);
  EXPECT_TRUE(chat["fluxion"]["policy"].is_null());  // not reported
  EXPECT_FALSE(chat["fluxion"].contains("read_fraction"));
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "hi");
}

TEST(OpenAiResponseTest, SseFraming) {
  EXPECT_EQ(SseEvent("{}"), "data: {}\n\n");
  EXPECT_EQ(std::string(kSseDone), "data: [DONE]\n\n");
  ResponseMeta meta{Endpoint::kChatCompletions, "chatcmpl-1", 5, "m"};
  Json first = EventJson(SseEvent(ChunkJson(meta, 0, "", true, nullptr, true)));
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(first.contains("usage") && first["usage"].is_null());
  EXPECT_FALSE(first.contains("fluxion"));
  ChoiceEnd stop{"stop"};
  stop.stop_string = "\n\n";
  stop.policy = "lfps";
  Json last = EventJson(SseEvent(ChunkJson(meta, 0, "", false, &stop, false)));
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(last["choices"][0]["stop_reason"], "\n\n");
  EXPECT_EQ(last["fluxion"]["policy"], "lfps");
  EXPECT_EQ(EventJson(SseEvent(ChunkJson(meta, 3, "x", false, nullptr, false)))["choices"][0]
                     ["index"],
            3);
  EXPECT_TRUE(last["choices"][0]["delta"].empty());
  EXPECT_FALSE(last.contains("usage"));
  Json usage = EventJson(SseEvent(UsageChunkJson(meta, {2, 3})));
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 3);
  meta.endpoint = Endpoint::kCompletions;
  Json text = EventJson(SseEvent(ChunkJson(meta, 0, "a\nb", false, nullptr, false)));
  EXPECT_EQ(text["choices"][0]["text"], "a\nb");  // a newline in text never splits the event
  EXPECT_EQ(SseEvent(ChunkJson(meta, 0, "a\nb", false, nullptr, false)).find("\n"),
            SseEvent(ChunkJson(meta, 0, "a\nb", false, nullptr, false)).size() - 2);
}

TEST(OpenAiResponseTest, ModelsList) {
  EXPECT_FALSE(Json::parse(ModelsJson("tiny", 9))["data"][0].contains("max_model_len"));
  Json j = Json::parse(ModelsJson("tiny", 9, 4096));
  EXPECT_EQ(j["data"][0]["max_model_len"], 4096);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["data"][0]["id"], "tiny");
  EXPECT_EQ(j["data"][0]["object"], "model");
}

TEST(OpenAiResponseTest, LogprobsInTheCompletionsAndChatShapes) {
  // An echoed first prompt token (no logprob), then a token whose alternatives lack it, and one
  // ruled out (-inf: JSON has no such number).
  std::vector<LogprobEntry> entries(3);
  entries[0].token = "A";
  entries[0].bytes = "A";
  entries[1].token = "b";
  entries[1].bytes = "b";
  entries[1].logprob = -2.0f;
  entries[1].top = {{"c", "c", -0.5f}};
  entries[1].text_offset = 1;
  entries[2].token = "\xef\xbf\xbd";
  entries[2].bytes = "\xc3";
  entries[2].logprob = -INFINITY;
  entries[2].text_offset = 2;
  ChoiceOutput out{"Abx", {"length"}};
  out.logprobs = entries;
  ResponseMeta meta{Endpoint::kCompletions, "cmpl-1", 100, "m"};
  const Json c = Json::parse(CompletionJson(meta, {out}, {1, 2}))["choices"][0]["logprobs"];
  EXPECT_EQ(c["tokens"], Json::array({"A", "b", "\xef\xbf\xbd"}));
  EXPECT_TRUE(c["token_logprobs"][0].is_null());
  EXPECT_TRUE(c["top_logprobs"][0].is_null());
  EXPECT_EQ(c["token_logprobs"][1], -2.0);
  EXPECT_EQ(c["token_logprobs"][2], -9999.0);
  // Up to logprobs + 1 alternatives: the position's own token joins them.
  EXPECT_EQ(c["top_logprobs"][1], Json({{"c", -0.5}, {"b", -2.0}}));
  EXPECT_EQ(c["text_offset"], Json::array({0, 1, 2}));

  meta.endpoint = Endpoint::kChatCompletions;
  std::vector<LogprobEntry> delta(entries.begin() + 1, entries.end());
  const Json chunk = Json::parse(ChunkJson(meta, 0, "b", false, nullptr, false, &delta));
  const Json& content = chunk["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], "b");
  EXPECT_EQ(content[0]["logprob"], -2.0);
  EXPECT_EQ(content[0]["bytes"], Json::array({98}));
  EXPECT_EQ(content[0]["top_logprobs"][0],
            Json({{"token", "c"}, {"logprob", -0.5}, {"bytes", {99}}}));
  EXPECT_EQ(content[1]["bytes"], Json::array({0xc3}));
  // Without logprobs the field stays null.
  EXPECT_TRUE(Json::parse(ChunkJson(meta, 0, "b", false, nullptr, false))["choices"][0]["logprobs"]
                  .is_null());
}

}  // namespace
TEST(OpenAiResponseTest, VersionIsVllmsShape) {
  EXPECT_EQ(VersionJson("0.1.0+abc"), R"({"version":"0.1.0+abc"})");
}

}  // namespace fluxion::cluster::openai
