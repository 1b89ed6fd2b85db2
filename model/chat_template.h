// Chat templates: the prompt text for a list of chat messages (docs/CHAT.md).
//
// No maintained C++ library in Debian 12 renders Hugging Face's Jinja2 chat templates (inja is not
// packaged there, and the real templates need Jinja2 features inja lacks: `namespace`,
// `raise_exception`, `strftime_now`, filters such as `trim` and `tojson(indent=4)`, slicing). So
// a model's `chat_template` is recognized, not interpreted: Load reads tokenizer_config.json's
// template (or, without one, config.json's model_type) and picks one of the built-in renderers,
// each written to produce, for plain system / user / assistant messages, exactly the text the
// real template renders (tests/data/chat/: references rendered by Jinja2 as transformers sets it
// up). A template that none of them reproduces is FailedPrecondition, never a guess.
//
// Thread-safe: a value type; const members may be called concurrently.
#ifndef FLUXION_MODEL_CHAT_TEMPLATE_H_
#define FLUXION_MODEL_CHAT_TEMPLATE_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace fluxion::model {

inline constexpr size_t kMaxTokenizerConfigBytes = size_t{16} << 20;  // tokenizer_config.json
inline constexpr size_t kMaxChatTemplateBytes = size_t{1} << 20;      // its chat_template

struct ChatMessage {
  std::string role;
  std::string content;
};

class ChatTemplate {
 public:
  enum class Kind {
    kLlama3,  // Llama-3 / 3.1 / 3.2 / 3.3 Instruct: <|start_header_id|>role<|end_header_id|>
    kChatMl,  // ChatML (Qwen2, Qwen2.5, ...): <|im_start|>role\n...<|im_end|>\n
    kPlain,   // Fluxion's own byte-level models: "role: content\n" (docs/CHAT.md)
  };

  // From the model directory (tokenizer_config.json's chat_template, config.json's model_type).
  // FailedPrecondition naming the directory and what was found when no built-in template
  // reproduces the model's; InvalidArgument for an unreadable or oversized file.
  static absl::StatusOr<ChatTemplate> Load(const std::string& model_dir);

  // From a chat_template string (with the tokenizer's bos_token, used by Llama-3's template).
  // `what` names the source in errors.
  static absl::StatusOr<ChatTemplate> FromTemplateText(absl::string_view template_text,
                                                       absl::string_view bos_token,
                                                       absl::string_view what);

  // A built-in template by kind, for tests and for models without a template file.
  static ChatTemplate BuiltIn(Kind kind);

  // The prompt text for `messages`, ending with the assistant turn's header when
  // add_generation_prompt. InvalidArgument for an unknown role or an empty list.
  // Content is inserted verbatim, as the real templates do: text that spells a special token
  // ("<|eot_id|>") becomes that token when the prompt is encoded (docs/CHAT.md).
  absl::StatusOr<std::string> Render(absl::Span<const ChatMessage> messages,
                                     bool add_generation_prompt) const;

  const std::string& name() const { return name_; }  // "llama3", "llama3.1", "chatml", "plain"
  Kind kind() const { return kind_; }

  // Llama-3.1-style templates write a system turn with "Cutting Knowledge Date" / "Today Date"
  // lines even without a system message; `today` is the date written there ("26 Jul 2024",
  // Llama-3.1's template default; Llama-3.2's uses the current date: see Load).
  bool has_date_preamble() const { return date_preamble_; }
  const std::string& today() const { return today_; }
  void set_today(std::string today) { today_ = std::move(today); }

 private:
  ChatTemplate() = default;
  std::string RenderLlama3(absl::Span<const ChatMessage> messages, bool generation) const;
  std::string RenderChatMl(absl::Span<const ChatMessage> messages, bool generation) const;
  std::string RenderPlain(absl::Span<const ChatMessage> messages, bool generation) const;

  Kind kind_ = Kind::kChatMl;
  std::string name_;
  std::string bos_;             // Llama-3: written first
  bool date_preamble_ = false;  // Llama-3.1 style default system turn
  std::string today_;           // Today Date: ...
  std::string default_system_;  // ChatML: system turn when the first message is not one
};

// Python's str.strip() (Jinja2's `trim` filter): removes leading and trailing characters that
// Python counts as whitespace (str.isspace), on UTF-8 text.
std::string PythonStrip(absl::string_view text);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_CHAT_TEMPLATE_H_
