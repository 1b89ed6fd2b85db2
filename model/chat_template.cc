#include "model/chat_template.h"

#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "model/config.h"
#include "model/json_text.h"

namespace fluxion::model {
namespace {

using Json = nlohmann::ordered_json;

// The parsed file, std::nullopt when absent.
absl::StatusOr<std::optional<nlohmann::json>> ReadJsonFile(const std::string& path,
                                                           size_t limit) {
  absl::StatusOr<std::string> text = ReadFileBounded(path, limit);
  if (absl::IsNotFound(text.status())) return std::optional<nlohmann::json>();
  if (!text.ok()) return text.status();
  FLUXION_ASSIGN_OR_RETURN(nlohmann::json json, ParseJsonText(*text, path, {64, false}));
  if (!json.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, " is not an object"));
  return std::optional<nlohmann::json>(std::move(json));
}

// A token field of tokenizer_config.json: a string, or an AddedToken object with "content".
std::string TokenField(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  return "";
}

// tokenizer_config.json's chat_template: a string, or a list of named templates of which
// transformers uses "default"; nullopt without one.
absl::StatusOr<std::optional<std::string>> TemplateText(const nlohmann::json& config,
                                                        const std::string& path) {
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_array()) {
    for (const nlohmann::json& named : *it) {
      if (named.is_object() && named.value("name", "") == "default" &&
          named.contains("template") && named["template"].is_string()) {
        return std::optional<std::string>(named["template"].get<std::string>());
      }
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      path, ": chat_template is neither a string nor a list holding a \"default\" template"));
}

bool IsByteLevelModel(const nlohmann::json& config) {
  const auto number = [&](const char* key) -> int64_t {
    auto f = config.find(key);
    return f != config.end() && f->is_number_integer() ? f->get<int64_t>() : -1;
  };
  return number("vocab_size") == 264 && number("bos_token_id") == 256 &&
         number("eos_token_id") == 257;
}

}  // namespace

ChatTemplate ChatTemplate::Plain() {
  ChatTemplate t;
  t.name_ = "plain";
  return t;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromTemplateText(absl::string_view template_text,
                                                            absl::string_view bos_token,
                                                            absl::string_view eos_token,
                                                            absl::string_view what) {
  if (template_text.size() > kMaxChatTemplateBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the chat template is larger than ",
                                                   kMaxChatTemplateBytes, " bytes"));
  }
  absl::StatusOr<jinja::Template> parsed = jinja::Template::Parse(template_text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", parsed.status().message()));
  }
  ChatTemplate t;
  t.template_ = std::make_shared<const jinja::Template>(*std::move(parsed));
  t.name_ = absl::StrCat(what, " (", template_text.size(), " bytes)");
  t.bos_ = std::string(bos_token);
  t.eos_ = std::string(eos_token);
  return t;
}

absl::StatusOr<ChatTemplate> ChatTemplate::Load(const std::string& model_dir,
                                                const std::string& template_file) {
  const std::string tc_path = model_dir + "/tokenizer_config.json";
  FLUXION_ASSIGN_OR_RETURN(std::optional<nlohmann::json> tc,
                           ReadJsonFile(tc_path, kMaxTokenizerConfigBytes));
  const std::string bos = tc.has_value() ? TokenField(*tc, "bos_token") : "";
  const std::string eos = tc.has_value() ? TokenField(*tc, "eos_token") : "";
  if (!template_file.empty()) {
    FLUXION_ASSIGN_OR_RETURN(const std::string text,
                             ReadFileBounded(template_file, kMaxChatTemplateBytes));
    return FromTemplateText(text, bos, eos, template_file);
  }
  if (tc.has_value()) {
    FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> text, TemplateText(*tc, tc_path));
    if (text.has_value()) return FromTemplateText(*text, bos, eos, tc_path);
  }
  FLUXION_ASSIGN_OR_RETURN(std::optional<nlohmann::json> config,
                           ReadJsonFile(model_dir + "/config.json", kMaxConfigBytes));
  if (config.has_value() && IsByteLevelModel(*config)) return Plain();  // docs/CHAT.md
  return absl::FailedPreconditionError(absl::StrCat(
      model_dir, " has no chat template (no chat_template in ",
      tc.has_value() ? "its tokenizer_config.json" : "a tokenizer_config.json",
      "): pass one with --chat-template FILE (docs/CHAT.md)"));
}

absl::StatusOr<std::string> ChatTemplate::Render(absl::Span<const ChatMessage> messages,
                                                 bool add_generation_prompt,
                                                 const Json& kwargs) const {
  if (messages.empty()) return absl::InvalidArgumentError("messages must not be empty");
  if (template_ == nullptr) {  // Our byte-level models were trained on no chat format.
    std::string out;
    for (const ChatMessage& m : messages) absl::StrAppend(&out, m.role, ": ", m.content, "\n");
    if (add_generation_prompt) absl::StrAppend(&out, "assistant: ");
    return out;
  }
  Json context = kwargs.is_object() ? kwargs : Json::object();
  Json list = Json::array();
  for (const ChatMessage& m : messages) {
    Json message = {{"role", m.role}, {"content", m.content}};
    if (!m.name.empty()) message["name"] = m.name;
    list.push_back(std::move(message));
  }
  context["messages"] = std::move(list);
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = bos_;
  context["eos_token"] = eos_;
  absl::StatusOr<std::string> text = template_->Render(context, absl::ToUnixSeconds(absl::Now()));
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model's chat template refused the messages: ", text.status().message()));
  }
  return text;
}

}  // namespace fluxion::model
