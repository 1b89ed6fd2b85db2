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
    EXPECT_EQ(t->name(), model == "qwen2.5" ? "chatml" : model);
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

TEST(ChatTemplateTest, UnknownRoleAndEmptyListAreInvalidArgument) {
  for (const char* model : {"llama3.1", "qwen2.5"}) {
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(DataDir(model));
    ASSERT_TRUE(t.ok()) << t.status();
    std::vector<ChatMessage> bad = {{"user", "hi"}, {"tool", "42"}};
    absl::StatusOr<std::string> r = t->Render(bad, true);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("messages[1].role is 'tool'"), std::string::npos)
        << r.status();
    EXPECT_EQ(t->Render({}, true).status().code(), absl::StatusCode::kInvalidArgument);
  }
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

TEST(ChatTemplateTest, NoTemplateChoosesByModelType) {
  ScopedTestTempDir dir;
  const std::string d = dir.path().string();
  WriteFile(d + "/config.json", R"({"model_type": "qwen2", "vocab_size": 151936})");
  absl::StatusOr<ChatTemplate> qwen = ChatTemplate::Load(d);
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_EQ(qwen->name(), "chatml");
  std::vector<ChatMessage> m = {{"user", "hi"}};
  EXPECT_EQ(*qwen->Render(m, true), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");

  WriteFile(d + "/config.json", R"({"model_type": "llama", "vocab_size": 128256})");
  WriteFile(d + "/tokenizer_config.json",
            R"({"bos_token": "<|begin_of_text|>", "added_tokens_decoder": {
                 "128006": {"content": "<|start_header_id|>"}, "128009": {"content": "<|eot_id|>"}}})");
  absl::StatusOr<ChatTemplate> llama = ChatTemplate::Load(d);
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->name(), "llama3");
  EXPECT_EQ(*llama->Render(m, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplateTest, UncoveredModelIsFailedPreconditionNamingTheDir) {
  ScopedTestTempDir dir;
  const std::string d = dir.path().string();
  WriteFile(d + "/config.json", R"({"model_type": "mistral"})");
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(d);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find(d), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("'mistral'"), std::string::npos) << t.status();

  // Marker tokens alone are not enough: a different turn layout is refused, not guessed.
  WriteFile(
      d + "/tokenizer_config.json",
      R"({"chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"})");
  t = ChatTemplate::Load(d);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("ChatML marker tokens"), std::string::npos) << t.status();

  WriteFile(d + "/tokenizer_config.json", R"({"chat_template": "[INST] {{ m }} [/INST]"})");
  t = ChatTemplate::Load(d);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("neither"), std::string::npos) << t.status();

  WriteFile(d + "/tokenizer_config.json", "{not json");
  EXPECT_EQ(ChatTemplate::Load(d).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, Llama32StyleUsesTodaysDate) {
  std::string tmpl =
      nlohmann::json::parse(ReadAll(DataDir("llama3.1/tokenizer_config.json")))["chat_template"];
  tmpl = "{%- set date_string = strftime_now(\"%d %b %Y\") %}" + tmpl;
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromTemplateText(tmpl, "<|begin_of_text|>", "x");
  ASSERT_TRUE(t.ok());
  EXPECT_NE(t->today(), "26 Jul 2024");
  EXPECT_EQ(t->today().size(), 11u);  // "02 Dec 2026"
}

TEST(PythonStripTest, StripsPythonWhitespace) {
  EXPECT_EQ(PythonStrip(" \t\n\x1c a b \xc2\xa0\xe3\x80\x80"), "a b");
  EXPECT_EQ(PythonStrip("\xe2\x80\x8b"
                        "a"),
            "\xe2\x80\x8b"
            "a");  // U+200B is not whitespace
  EXPECT_EQ(PythonStrip("   "), "");
  EXPECT_EQ(PythonStrip(""), "");
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
