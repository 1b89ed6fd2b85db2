#include "model/chat_template.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "model/config.h"
#include "model/json_text.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {
namespace {

using Json = nlohmann::json;

// The parsed file, std::nullopt when absent.
absl::StatusOr<std::optional<Json>> ReadJsonFile(const std::string& path, size_t limit) {
  absl::StatusOr<std::string> text = ReadFileBounded(path, limit);
  if (absl::IsNotFound(text.status())) return std::optional<Json>();
  if (!text.ok()) return text.status();
  FLUXION_ASSIGN_OR_RETURN(Json json, ParseJsonText(*text, path, {64, false}));
  if (!json.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, " is not an object"));
  return std::optional<Json>(std::move(json));
}

// A token field of tokenizer_config.json: a string, or an AddedToken object with "content".
std::string TokenField(const Json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  return "";
}

std::string WithoutWhitespace(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') out.push_back(c);
  }
  return out;
}

// The per-message expressions of the templates we reproduce, whitespace removed. Matching them,
// not just the marker tokens, is what keeps a template that merely uses the same tokens (with a
// different turn layout) from being rendered wrongly: it gets the error instead.
constexpr absl::string_view kLlama3Turns[] = {
    R"('<|start_header_id|>'+message['role']+'<|end_header_id|>\n\n'+message['content']|trim+'<|eot_id|>')",
    R"('<|start_header_id|>'+message.role+'<|end_header_id|>\n\n'+message.content|trim+'<|eot_id|>')",
};
constexpr absl::string_view kChatMlTurns[] = {
    R"('<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>'+'\n')",
    R"('<|im_start|>'+message.role+'\n'+message.content+'<|im_end|>'+'\n')",
    R"('<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>\n')",
    R"('<|im_start|>'+message.role+'\n'+message.content+'<|im_end|>\n')",
};

bool ContainsAny(absl::string_view text, absl::Span<const absl::string_view> needles) {
  for (absl::string_view needle : needles) {
    if (absl::StrContains(text, needle)) return true;
  }
  return false;
}

// ChatML's default system prompt: the literal '<|im_start|>system\n...<|im_end|>' the template
// writes when the first message is not a system one (Qwen2: "You are a helpful assistant.",
// Qwen2.5: "You are Qwen, created by Alibaba Cloud. ..."); empty when it has none.
std::string ChatMlDefaultSystem(absl::string_view template_text) {
  constexpr absl::string_view kOpen = R"('<|im_start|>system\n)";
  size_t pos = 0;
  while ((pos = template_text.find(kOpen, pos)) != absl::string_view::npos) {
    pos += kOpen.size();
    const size_t end = template_text.find("<|im_end|>", pos);
    if (end == absl::string_view::npos) break;
    absl::string_view body = template_text.substr(pos, end - pos);
    if (!body.empty() && body.find_first_of("'\"+\\{}") == absl::string_view::npos) {
      return std::string(body);
    }
  }
  return "";
}

// "%d %b %Y" of today, UTC: what Llama-3.2's strftime_now("%d %b %Y") writes (the C locale's
// English month abbreviations, as Python's).
std::string TodayUtc() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buffer[32];
  const size_t n = std::strftime(buffer, sizeof(buffer), "%d %b %Y", &tm);
  return std::string(buffer, n);
}

// One UTF-8 code point at text[i]; returns its length (1 for an invalid byte).
size_t CodePointAt(absl::string_view text, size_t i, char32_t* cp) {
  const unsigned char c = static_cast<unsigned char>(text[i]);
  size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + len > text.size()) len = 1;
  if (len == 1) {
    *cp = c;
    return 1;
  }
  char32_t value = c & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) value = (value << 6) | (text[i + k] & 0x3F);
  *cp = value;
  return len;
}

// Python's str.isspace (Unicode White_Space plus the separators \x1c-\x1f).
bool IsPythonSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

absl::Status CheckMessages(absl::Span<const ChatMessage> messages) {
  if (messages.empty()) return absl::InvalidArgumentError("messages is empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i, "].role is '", role,
                       "': only 'system', 'user' and 'assistant' are supported"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string PythonStrip(absl::string_view text) {
  size_t begin = 0;
  while (begin < text.size()) {
    char32_t cp;
    const size_t len = CodePointAt(text, begin, &cp);
    if (!IsPythonSpace(cp)) break;
    begin += len;
  }
  size_t end = begin;  // one past the last non-space code point
  for (size_t i = begin; i < text.size();) {
    char32_t cp;
    const size_t len = CodePointAt(text, i, &cp);
    i += len;
    if (!IsPythonSpace(cp)) end = i;
  }
  return std::string(text.substr(begin, end - begin));
}

ChatTemplate ChatTemplate::BuiltIn(Kind kind) {
  ChatTemplate t;
  t.kind_ = kind;
  switch (kind) {
    case Kind::kLlama3:
      t.name_ = "llama3";
      t.bos_ = "<|begin_of_text|>";
      break;
    case Kind::kChatMl:
      t.name_ = "chatml";
      break;
    case Kind::kPlain:
      t.name_ = "plain";
      break;
  }
  return t;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromTemplateText(absl::string_view template_text,
                                                            absl::string_view bos_token,
                                                            absl::string_view what) {
  const std::string compact = WithoutWhitespace(template_text);
  const bool llama_markers = absl::StrContains(template_text, "<|start_header_id|>") &&
                             absl::StrContains(template_text, "<|eot_id|>");
  const bool chatml_markers = absl::StrContains(template_text, "<|im_start|>") &&
                              absl::StrContains(template_text, "<|im_end|>");
  if (llama_markers && ContainsAny(compact, kLlama3Turns)) {
    ChatTemplate t = BuiltIn(Kind::kLlama3);
    if (!bos_token.empty()) t.bos_ = std::string(bos_token);
    if (!absl::StrContains(template_text, "bos_token")) t.bos_.clear();
    if (absl::StrContains(template_text, "Cutting Knowledge Date")) {
      t.name_ = "llama3.1";
      t.date_preamble_ = true;
      // Llama-3.1/3.3: `date_string` defaults to "26 Jul 2024" and transformers passes none;
      // Llama-3.2: strftime_now("%d %b %Y") when the renderer defines it (transformers does).
      t.today_ = absl::StrContains(template_text, "strftime_now") ? TodayUtc() : "26 Jul 2024";
    }
    return t;
  }
  if (chatml_markers && ContainsAny(compact, kChatMlTurns)) {
    ChatTemplate t = BuiltIn(Kind::kChatMl);
    t.default_system_ = ChatMlDefaultSystem(template_text);
    return t;
  }
  const char* found = llama_markers ? "Llama-3 marker tokens with a turn layout we do not reproduce"
                      : chatml_markers
                          ? "ChatML marker tokens with a turn layout we do not reproduce"
                          : "neither Llama-3 nor ChatML marker tokens";
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": its chat_template (", template_text.size(), " bytes) has ", found,
                   "; Fluxion renders only Llama-3 and ChatML templates (docs/CHAT.md)"));
}

absl::StatusOr<ChatTemplate> ChatTemplate::Load(const std::string& model_dir) {
  const std::string tc_path = model_dir + "/tokenizer_config.json";
  FLUXION_ASSIGN_OR_RETURN(std::optional<Json> tc, ReadJsonFile(tc_path, kMaxTokenizerConfigBytes));
  if (tc.has_value()) {
    auto it = tc->find("chat_template");
    if (it != tc->end() && !it->is_null()) {
      if (!it->is_string()) {
        // A list of named templates ({"name": "default", "template": ...}) or anything else.
        return absl::FailedPreconditionError(absl::StrCat(
            tc_path, ": chat_template is not a single string (named templates are not supported)"));
      }
      const std::string& text = it->get_ref<const std::string&>();
      if (text.size() > kMaxChatTemplateBytes) {
        return absl::InvalidArgumentError(absl::StrCat(tc_path, ": chat_template is larger than ",
                                                       kMaxChatTemplateBytes, " bytes"));
      }
      return FromTemplateText(text, TokenField(*tc, "bos_token"), tc_path);
    }
  }
  // No template: choose by config.json.
  const std::string config_path = model_dir + "/config.json";
  FLUXION_ASSIGN_OR_RETURN(std::optional<Json> config, ReadJsonFile(config_path, kMaxConfigBytes));
  if (!config.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat(model_dir, " has no tokenizer_config.json chat_template and no config.json"));
  }
  const std::string model_type = config->value("model_type", std::string());
  const auto number = [&](const char* key) -> int64_t {
    auto f = config->find(key);
    return f != config->end() && f->is_number_integer() ? f->get<int64_t>() : -1;
  };
  if (number("vocab_size") == 264 && number("bos_token_id") == 256 &&
      number("eos_token_id") == 257) {
    return BuiltIn(Kind::kPlain);  // our own byte-level models (docs/CHAT.md)
  }
  if (model_type == "qwen2") return BuiltIn(Kind::kChatMl);
  if (model_type == "llama" && tc.has_value() &&
      absl::StrContains(tc->dump(), "\"<|start_header_id|>\"") &&
      absl::StrContains(tc->dump(), "\"<|eot_id|>\"")) {
    ChatTemplate t = BuiltIn(Kind::kLlama3);
    const std::string bos = TokenField(*tc, "bos_token");
    if (!bos.empty()) t.bos_ = bos;
    return t;
  }
  return absl::FailedPreconditionError(
      absl::StrCat(model_dir, " has no chat_template in tokenizer_config.json",
                   tc.has_value() ? "" : " (no tokenizer_config.json)",
                   " and config.json's model_type '", model_type,
                   "' is neither qwen2 nor llama with a Llama-3 vocabulary; copy the model's "
                   "tokenizer_config.json in (docs/CHAT.md)"));
}

absl::StatusOr<std::string> ChatTemplate::Render(absl::Span<const ChatMessage> messages,
                                                 bool add_generation_prompt) const {
  FLUXION_RETURN_IF_ERROR(CheckMessages(messages));
  switch (kind_) {
    case Kind::kLlama3:
      return RenderLlama3(messages, add_generation_prompt);
    case Kind::kChatMl:
      return RenderChatMl(messages, add_generation_prompt);
    case Kind::kPlain:
      return RenderPlain(messages, add_generation_prompt);
  }
  return absl::InternalError("unknown chat template kind");
}

// Meta's templates: every turn is header + content|trim + <|eot_id|>. The 3.1 style takes the
// first system message out and always writes a system turn with the date lines before it.
std::string ChatTemplate::RenderLlama3(absl::Span<const ChatMessage> messages,
                                       bool generation) const {
  std::string out = bos_;
  if (date_preamble_) {
    std::string system;
    if (messages.front().role == "system") {
      system = PythonStrip(messages.front().content);
      messages = messages.subspan(1);
    }
    absl::StrAppend(&out, "<|start_header_id|>system<|end_header_id|>\n\n",
                    "Cutting Knowledge Date: December 2023\n", "Today Date: ", today_, "\n\n",
                    system, "<|eot_id|>");
  }
  for (const ChatMessage& m : messages) {
    absl::StrAppend(&out, "<|start_header_id|>", m.role, "<|end_header_id|>\n\n",
                    PythonStrip(m.content), "<|eot_id|>");
  }
  if (generation) absl::StrAppend(&out, "<|start_header_id|>assistant<|end_header_id|>\n\n");
  return out;
}

// ChatML: content verbatim (no trim); the default system turn, if the template has one, when the
// first message is not a system message.
std::string ChatTemplate::RenderChatMl(absl::Span<const ChatMessage> messages,
                                       bool generation) const {
  std::string out;
  if (messages.front().role != "system" && !default_system_.empty()) {
    absl::StrAppend(&out, "<|im_start|>system\n", default_system_, "<|im_end|>\n");
  }
  for (const ChatMessage& m : messages) {
    absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n");
  }
  if (generation) absl::StrAppend(&out, "<|im_start|>assistant\n");
  return out;
}

// Our byte-level models were trained on no chat format; this one only lets the demo chat.
std::string ChatTemplate::RenderPlain(absl::Span<const ChatMessage> messages,
                                      bool generation) const {
  std::string out;
  for (const ChatMessage& m : messages) absl::StrAppend(&out, m.role, ": ", m.content, "\n");
  if (generation) absl::StrAppend(&out, "assistant: ");
  return out;
}

}  // namespace fluxion::model
