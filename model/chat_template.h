// Chat templates: the prompt text for a list of chat messages (docs/CHAT.md).
//
// A model's `chat_template` (tokenizer_config.json's, or a file named by --chat-template) runs as
// the Jinja2 template it is, on model/jinja's interpreter, with the variables transformers'
// apply_chat_template passes: messages, add_generation_prompt, bos_token, eos_token, and the
// request's chat_template_kwargs. Our byte-level models, which ship no template, get a plain one.
//
// Thread-safe: a value type; const members may be called concurrently.
#ifndef FLUXION_MODEL_CHAT_TEMPLATE_H_
#define FLUXION_MODEL_CHAT_TEMPLATE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "model/jinja/jinja.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {

inline constexpr size_t kMaxTokenizerConfigBytes = size_t{16} << 20;  // tokenizer_config.json
inline constexpr size_t kMaxChatTemplateBytes = size_t{1} << 20;      // its chat_template

struct ChatMessage {
  std::string role;
  std::string content;
  std::string name = "";  // a participant's name; empty when none (not passed to the template)
};

class ChatTemplate {
 public:
  // From the model directory: `template_file` when given (a Jinja template, --chat-template),
  // else tokenizer_config.json's chat_template (a string, or named templates: the "default" one),
  // else, for our own byte-level models (config.json), the plain template. FailedPrecondition
  // naming the directory and --chat-template when there is none; InvalidArgument for a template
  // that does not parse or an unreadable or oversized file.
  static absl::StatusOr<ChatTemplate> Load(const std::string& model_dir,
                                           const std::string& template_file = "");

  // From template text, with the tokenizer's bos and eos tokens. `what` names the source in
  // errors.
  static absl::StatusOr<ChatTemplate> FromTemplateText(absl::string_view template_text,
                                                       absl::string_view bos_token,
                                                       absl::string_view eos_token,
                                                       absl::string_view what);

  // Our byte-level models': "role: content\n" per message, "assistant: " to generate.
  static ChatTemplate Plain();

  // The prompt text for `messages`. `kwargs` (a JSON object: the request's
  // chat_template_kwargs) adds template variables; messages, add_generation_prompt, bos_token and
  // eos_token are ours. InvalidArgument for an empty list or whatever the template refuses
  // (its raise_exception message, e.g. roles that do not alternate). Content is inserted
  // verbatim, as the real templates do: text that spells a special token ("<|eot_id|>") becomes
  // that token when the prompt is encoded (docs/CHAT.md).
  absl::StatusOr<std::string> Render(absl::Span<const ChatMessage> messages,
                                     bool add_generation_prompt,
                                     const nlohmann::ordered_json& kwargs =
                                         nlohmann::ordered_json::object()) const;

  // Where the template came from, for logs and ServerInfo ("plain", or the file and its size).
  const std::string& name() const { return name_; }

 private:
  ChatTemplate() = default;

  std::shared_ptr<const jinja::Template> template_;  // null: the plain template
  std::string name_;
  std::string bos_, eos_;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_CHAT_TEMPLATE_H_
