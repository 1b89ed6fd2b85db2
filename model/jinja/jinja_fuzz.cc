// libFuzzer target: template text -> jinja::Template::Parse -> Render over a chat-like context. Any
// input must parse or fail with a status, and render or fail with one: no crash, no sanitizer
// report, no stack exhaustion (nesting is bounded at parse time) and no hang (rendering is
// bounded in steps and output). docs/FUZZING.md.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "model/jinja/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using fluxion::model::jinja::Template;
  static const nlohmann::ordered_json* context = new nlohmann::ordered_json(
      nlohmann::ordered_json::parse(R"({"messages": [{"role": "system", "content": " s "},
        {"role": "user", "content": "caf\u00e9 <b>"}, {"role": "assistant", "content": "ok",
        "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, 2.5, null]}}}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})"));
  absl::StatusOr<Template> t =
      Template::Parse(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!t.ok()) return 0;
  (void)t->Render(*context, 0);
  return 0;
}
