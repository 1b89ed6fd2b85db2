#include "model/jinja/jinja.h"

#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace fluxion::model::jinja {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;

Json ReadJson(const std::string& relative) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  std::ifstream in(std::string(src ? src : ".") + "/" + relative);
  std::stringstream text;
  text << in.rdbuf();
  return Json::parse(text.str());
}

// tests/data/jinja/cases.json: one small template per language feature chat templates use, and
// Jinja2's own rendering in transformers' environment (tools/hf_reference/make_jinja_refs.py).
TEST(JinjaTest, RendersEveryCaseAsJinja2Does) {
  setenv("TZ", "UTC", 1);  // the references' strftime_now is in UTC
  tzset();
  const Json refs = ReadJson("tests/data/jinja/cases.json");
  ASSERT_GE(refs["cases"].size(), 25u);
  for (const Json& c : refs["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    auto t = Template::Parse(c["template"].get<std::string>());
    ASSERT_TRUE(t.ok()) << t.status();
    // A case may carry its own variables; the others share the file's.
    const Json& context = c.contains("context") ? c["context"] : refs["context"];
    auto text = t->Render(context, refs["now"].get<int64_t>());
    if (c.contains("error")) {
      ASSERT_FALSE(text.ok()) << *text;
      EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
      if (c["name"] == "raise_exception") {
        EXPECT_THAT(text.status().message(), HasSubstr(c["error"].get<std::string>()));
      }
      continue;
    }
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_EQ(*text, c["text"].get<std::string>());
  }
}

// The real chat templates of tests/data/chat (Llama-3, Llama-3.1, Qwen2.5, ChatML) against the
// texts Jinja2 rendered for them.
TEST(JinjaTest, RendersRealChatTemplatesAsJinja2Does) {
  const Json refs = ReadJson("tests/data/chat/references.json");
  for (const auto& [model, cases] : refs.items()) {
    const Json config = ReadJson("tests/data/chat/" + model + "/tokenizer_config.json");
    auto t = Template::Parse(config["chat_template"].get<std::string>());
    ASSERT_TRUE(t.ok()) << model << ": " << t.status();
    for (const Json& c : cases) {
      SCOPED_TRACE(model + " " + c["case"].get<std::string>());
      auto token = [&config](const char* key) {
        const Json& t = config.contains(key) ? config[key] : Json();
        return t.is_string() ? t.get<std::string>() : t.is_object() ? t.value("content", "") : "";
      };
      const Json context = {{"messages", c["messages"]},
                            {"add_generation_prompt", c["add_generation_prompt"]},
                            {"bos_token", token("bos_token")},
                            {"eos_token", token("eos_token")}};
      auto text = t->Render(context, 0);
      ASSERT_TRUE(text.ok()) << text.status();
      EXPECT_EQ(*text, c["text"].get<std::string>());
    }
  }
}

TEST(JinjaTest, BadTemplatesAndRunawayRendersAreInvalidArgument) {
  for (const char* bad : {"{% if x %}open", "{{ 1 + }}", "{% unknown %}", "{{ 'unclosed }}",
                          "{# never closed", "{% for %}{% endfor %}",
                          "{{ x[] }}", "{{ 99999999999999999999 }}" /* found by jinja_fuzz */}) {
    auto t = Template::Parse(bad);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(t.status().message(), HasSubstr("line 1")) << bad;
  }
  auto deep = Template::Parse("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}");
  EXPECT_EQ(deep.status().code(), absl::StatusCode::kInvalidArgument);
  auto forever = Template::Parse(
      "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}x"
      "{% endfor %}{% endfor %}{% endfor %}");
  ASSERT_TRUE(forever.ok());
  auto r = forever->Render(Json::object(), 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  // Values are bounded as the output is, and integers do not overflow silently (jinja_fuzz).
  for (const char* bad : {"{{ 9223372036854775807 + 1 }}", "{{ -9223372036854775807 - 2 }}",
                          "{{ 2 ** 64 }}",
                          "{% set ns = namespace(s='x') %}{% for i in range(100) %}"
                          "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                          "{{ 'ab' * 100000000 }}", "{{ 'a'|indent(100000) }}"}) {
    auto t = Template::Parse(bad);
    ASSERT_TRUE(t.ok()) << bad << ": " << t.status();
    EXPECT_EQ(t->Render(Json::object(), 0).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  auto recursive = Template::Parse("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}");
  ASSERT_TRUE(recursive.ok());
  EXPECT_EQ(recursive->Render(Json::object(), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::model::jinja
