#include "model/chat_template.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_temp_dir.h"
#include "gtest/gtest.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {
namespace {

std::string DataDir(const std::string& name) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(src ? src : ".") + "/tests/data/chat/" + name;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Every reference of tests/data/chat/references.json (Jinja2 3.1.6 rendering the real
// templates as transformers does, render_reference.py) is reproduced exactly.
TEST(ChatTemplateReferenceTest, MatchesJinja2Renderings) {
  const nlohmann::json refs = nlohmann::json::parse(ReadAll(DataDir("references.json")));
  ASSERT_EQ(refs.size(), 4u);
  for (const auto& [model, cases] : refs.items()) {
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(DataDir(model));
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_NE(t->name().find("tokenizer_config.json"), std::string::npos) << t->name();
    ASSERT_GE(cases.size(), 10u);
    for (const auto& c : cases) {
      std::vector<ChatMessage> messages;
      for (const auto& m : c["messages"]) messages.push_back({m["role"], m["content"]});
      absl::StatusOr<std::string> text = t->Render(messages, c["add_generation_prompt"]);
      ASSERT_TRUE(text.ok()) << text.status();
      EXPECT_EQ(*text, c["text"].get<std::string>())
          << model << " " << c["case"] << " gen=" << c["add_generation_prompt"];
    }
  }
}

// What a template refuses (its raise_exception) is InvalidArgument carrying its message; so is an
// empty list.
TEST(ChatTemplateTest, WhatTheTemplateRefusesIsInvalidArgument) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromTemplateText(
      "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
      "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
      "[{{ m.role }}]{{ m.content }}{% endfor %}",
      "<s>", "</s>", "test");
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<ChatMessage> bad = {{"user", "a"}, {"user", "b"}};
  absl::StatusOr<std::string> r = t->Render(bad, true);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("roles must alternate"), std::string::npos) << r.status();
  EXPECT_EQ(t->Render({}, true).status().code(), absl::StatusCode::kInvalidArgument);
}

// Content that spells a special token is inserted verbatim, as the real templates do, so
// encoding the prompt turns it into the control token (HF's apply_chat_template does the same).
TEST(ChatTemplateTest, SpecialTokenTextInContentIsVerbatim) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(DataDir("qwen2.5"));
  ASSERT_TRUE(t.ok());
  std::vector<ChatMessage> m = {{"user", "a<|im_end|>b"}};
  absl::StatusOr<std::string> text = t->Render(m, false);
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find("user\na<|im_end|>b<|im_end|>\n"), std::string::npos);
}

TEST(ChatTemplateTest, TinyByteModelGetsPlainTemplate) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  absl::StatusOr<ChatTemplate> t =
      ChatTemplate::Load(std::string(src ? src : ".") + "/models/fluxion-tiny-retrieval");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->name(), "plain");
  std::vector<ChatMessage> m = {{"system", "S"}, {"user", "U"}, {"assistant", "A"}};
  EXPECT_EQ(*t->Render(m, true), "system: S\nuser: U\nassistant: A\nassistant: ");
  EXPECT_EQ(*t->Render(m, false), "system: S\nuser: U\nassistant: A\n");
}

// Without a template nothing is guessed: the error names --chat-template, which supplies one.
TEST(ChatTemplateTest, NoTemplateIsRefusedNamingChatTemplateFlag) {
  ScopedTestTempDir dir;
  const std::string d = dir.path().string();
  WriteFile(d + "/config.json", R"({"model_type": "mistral", "vocab_size": 32768})");
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(d);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find(d), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("--chat-template"), std::string::npos) << t.status();

  WriteFile(d + "/mistral.jinja",
            "{{ bos_token }}{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}");
  WriteFile(d + "/tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>"})");
  t = ChatTemplate::Load(d, d + "/mistral.jinja");
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<ChatMessage> m = {{"user", "hi"}};
  EXPECT_EQ(*t->Render(m, true), "<s>[INST] hi [/INST]");
  EXPECT_EQ(ChatTemplate::Load(d, d + "/absent.jinja").status().code(),
            absl::StatusCode::kNotFound);
}

// tokenizer_config.json's named templates: the "default" one; a template that does not parse
// names the file and the line; a file that is not JSON is InvalidArgument.
TEST(ChatTemplateTest, NamedTemplatesAndBadTemplates) {
  ScopedTestTempDir dir;
  const std::string d = dir.path().string();
  WriteFile(d + "/tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D{{ messages|length }}"}]})");
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(d);
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<ChatMessage> m = {{"user", "hi"}};
  EXPECT_EQ(*t->Render(m, true), "D1");

  WriteFile(d + "/tokenizer_config.json", R"({"chat_template": "a\n{% if x %}never closed"})");
  t = ChatTemplate::Load(d);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("tokenizer_config.json"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("line 2"), std::string::npos) << t.status();

  WriteFile(d + "/tokenizer_config.json", "{not json");
  EXPECT_EQ(ChatTemplate::Load(d).status().code(), absl::StatusCode::kInvalidArgument);
}

// chat_template_kwargs become template variables (Qwen3's enable_thinking); the messages stay ours.
TEST(ChatTemplateTest, KeywordArgumentsReachTheTemplate) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromTemplateText(
      "{{ messages[0].content }}{% if enable_thinking is defined and not enable_thinking %}"
      " /no_think{% endif %}{{ strftime_now('%Y')|length }}",
      "", "", "test");
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<ChatMessage> m = {{"user", "hi"}};
  EXPECT_EQ(*t->Render(m, true), "hi4");
  EXPECT_EQ(*t->Render(m, true, {{"enable_thinking", false}, {"messages", "ignored"}}),
            "hi /no_think4");
}

// The rendered Llama-3.1 prompt encodes its markers as the special tokens (one id each).
TEST(ChatTemplateTest, RenderedMarkersAreSpecialTokensOfTheTokenizer) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  auto tok = LoadTokenizer(std::string(src ? src : ".") + "/tests/data/tokenizers/llama3");
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(DataDir("llama3.1"));
  ASSERT_TRUE(t.ok());
  std::vector<ChatMessage> m = {{"user", "hi"}};
  auto ids = (*tok)->Encode(*t->Render(m, true));
  ASSERT_TRUE(ids.ok());
  const auto bos = (*tok)->TokenToId("<|begin_of_text|>");
  const auto header = (*tok)->TokenToId("<|start_header_id|>");
  ASSERT_TRUE(bos.has_value() && header.has_value());
  ASSERT_GE(ids->size(), 3u);
  EXPECT_EQ((*ids)[0], *bos);
  EXPECT_EQ((*ids)[1], *header);
}

}  // namespace
}  // namespace fluxion::model
