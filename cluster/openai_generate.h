// From an OpenAI request to a fluxion.v1 GenerateRequest: the prompt rendered (chat template) and
// tokenized with the model's tokenizer, sampling fields mapped one to one (docs/PROTOCOL.md,
// "Mapping onto fluxion.v1").
//
// Thread-safe: pure functions (the tokenizer's const members are thread-safe).
#ifndef FLUXION_CLUSTER_OPENAI_GENERATE_H_
#define FLUXION_CLUSTER_OPENAI_GENERATE_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cluster/openai_request.h"
#include "fluxion/v1/decode.pb.h"
#include "model/tokenizer.h"

namespace fluxion::cluster::openai {

// The prompt text for a conversation, ending with the assistant turn's header; `kwargs` are the
// request's chat_template_kwargs. Empty function: the router has no chat template, and chat
// requests are refused.
using ChatRenderer = std::function<absl::StatusOr<std::string>(const std::vector<Message>&,
                                                               const nlohmann::json& kwargs)>;

// The request's prompt as token ids: the chat template rendered and tokenized (chat), the text
// tokenized (completions; no BOS added, as Tokenizer::Encode), or the given ids. InvalidArgument
// naming the field for a prompt empty after tokenization or holding ids outside the vocabulary;
// the renderer's error; the tokenizer's (or `check`'s) naming the field.
// `index` picks the completions prompt (< PromptCount(request)).
absl::StatusOr<std::vector<uint32_t>> PromptIds(const Request& request,
                                                const model::Tokenizer& tokenizer,
                                                const ChatRenderer& chat, size_t index = 0,
                                                const model::EncodeCheck& check = {});

// One choice's Generate call, and the prompt it continues (its index in the request).
struct PreparedChoice {
  v1::GenerateRequest generate;
  size_t prompt = 0;
};

// Every choice's Generate call, in choice order (prompt p's j-th of n at p * n + j): PromptIds
// for each prompt, the sampling fields mapped one to one; with several choices each request id
// is `request_id`.<choice> and a given seed is seed + j. Errors: PromptIds' (the renderer's,
// the tokenizer's or `check`'s, which bounds the tokenization: model::EncodeCheck, naming the
// field), InvalidArgument naming the field for a stop token id outside the vocabulary,
// CheckContextLength's when `max_context_tokens` > 0.
absl::StatusOr<std::vector<PreparedChoice>> PrepareGenerate(const Request& request,
                                                            const model::Tokenizer& tokenizer,
                                                            const ChatRenderer& chat,
                                                            const std::string& request_id,
                                                            const model::EncodeCheck& check = {},
                                                            int64_t max_context_tokens = 0);

// A prompt of `prompt_tokens` (and max_tokens, when given) against the model's context of
// `max_context_tokens`: InvalidArgument in the wording OpenAI clients match ("This model's maximum
// context length is N tokens. However, ..."), with param "messages" (chat) or "prompt" and code
// "context_length_exceeded", when the prompt leaves no room for a token or the prompt plus
// max_tokens exceed the context.
absl::Status CheckContextLength(Endpoint endpoint, int64_t prompt_tokens,
                                std::optional<uint32_t> max_tokens, int64_t max_context_tokens);

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_GENERATE_H_
