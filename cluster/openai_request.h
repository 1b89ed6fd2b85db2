// The OpenAI-compatible HTTP API's request bodies (docs/PROTOCOL.md, "OpenAI-compatible HTTP
// API"): POST /v1/completions and /v1/chat/completions parsed and validated into one Request.
// Every field the API defines is either mapped onto fluxion.v1, accepted because it changes
// nothing (its default value, or `user`), or refused with InvalidArgument naming it: a field that
// would be silently ignored makes a client believe it got behaviour it did not get.
//
// Errors carry the offending field's name as a payload (ErrorParam) so that the HTTP layer can
// fill OpenAI's `error.param`.
//
// Thread-safe: pure functions.
#ifndef FLUXION_CLUSTER_OPENAI_REQUEST_H_
#define FLUXION_CLUSTER_OPENAI_REQUEST_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fluxion::cluster::openai {

enum class Endpoint { kCompletions, kChatCompletions };

// One chat message: its role and its text (text parts of an array content joined).
struct Message {
  std::string role;
  std::string content;
  std::string name = "";  // a participant's name (passed to the chat template); empty when none
};

// One completions prompt: text, or token ids (exactly one of the two is set).
struct Prompt {
  std::optional<std::string> text;
  std::vector<uint32_t> ids;
};

struct Request {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  // Completions: at least one prompt (a list gives one choice per prompt and n).
  std::vector<Prompt> prompts;
  // Chat: the conversation, at least one message.
  std::vector<Message> messages;
  // Chat: the request's chat_template_kwargs, extra variables for the chat template (an object).
  nlohmann::json chat_template_kwargs = nlohmann::json::object();
  // Choices per prompt (OpenAI's `n`); the answer holds prompts x n choices, choice
  // p * n + j for prompt p's j-th (vLLM's order).
  uint32_t n = 1;
  // max_tokens (or max_completion_tokens). Absent: completions default to 16 (OpenAI's
  // documented default); chat to the room the context leaves.
  std::optional<uint32_t> max_tokens;
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<uint32_t> top_k;  // 0 (or vLLM's -1): off
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;         // stop strings, not included in the output
  std::vector<uint32_t> stop_token_ids;  // vLLM's extension: stop after any of these tokens
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // vLLM's extensions: EOS does not end the generation; a matched stop string is kept at the end
  // of the text; special tokens (BOS, EOS, chat markers) are left out of the text.
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  // Fluxion's extension `"fluxion": {"policy": "lfps", "budget": 0.05}`: the attention policy of
  // this request (empty: the decode node's default) and its budget (absent: the policy's).
  std::string policy;
  std::optional<float> budget;
  // Log-probabilities of each completion token and of its position's `logprobs` most likely
  // tokens (completions' `logprobs`; chat's `logprobs: true` with `top_logprobs`, default 0).
  // Absent: none. From the raw logits (model/logprobs.h).
  std::optional<uint32_t> logprobs;
  // Completions: the prompt's text precedes the completion's, and with `logprobs` so do the
  // prompt tokens' log-probabilities (the first token's null), as lm-eval's loglikelihood reads.
  bool echo = false;
  // OpenAI's penalties ([-2, 2]), vLLM's repetition_penalty (> 0; 1 off) and min_tokens (at most
  // max_tokens): model/logit_penalties.h.
  float presence_penalty = 0;
  float frequency_penalty = 0;
  std::optional<float> repetition_penalty;  // unset: generation_config.json's, else 1
  uint32_t min_tokens = 0;
};

// The most alternatives `logprobs` / `top_logprobs` may ask for (vLLM's default max_logprobs).
inline constexpr uint32_t kMaxLogprobs = 20;

// Bounds on what a body may hold, checked while parsing (the body's size is the HTTP layer's).
struct ParseLimits {
  int max_depth = 16;                // JSON nesting; deeper bodies are refused before the DOM
  size_t max_messages = 4096;        // chat messages
  size_t max_prompt_ids = 1u << 20;  // token ids of a prompt given as ids
  size_t max_stop_token_ids = 256;
  // Choices of one request (prompts x n): each is its own Generate on the router.
  size_t max_choices = 128;
};

// The prompts a request's choices come from: its completions prompts, or its one conversation.
inline size_t PromptCount(const Request& r) {
  return r.endpoint == Endpoint::kChatCompletions ? 1 : r.prompts.size();
}

// Completions' default max_tokens (https://platform.openai.com/docs/api-reference/completions).
inline constexpr uint32_t kDefaultCompletionMaxTokens = 16;

// Parses and validates `body`. InvalidArgument with a message a user can act on; the field it is
// about (when one) is in ErrorParam(status). The body must be an object without duplicate keys.
absl::StatusOr<Request> ParseRequest(Endpoint endpoint, absl::string_view body,
                                     const ParseLimits& limits = {});

// The field an error names, for OpenAI's `error.param`; empty when none.
std::string ErrorParam(const absl::Status& status);
// `status` with `param` attached (what ErrorParam returns).
absl::Status WithParam(absl::Status status, absl::string_view param);
// OpenAI's machine-readable `error.code` an error carries (e.g. "context_length_exceeded"); empty
// when none. WithCode attaches it.
std::string ErrorCode(const absl::Status& status);
absl::Status WithCode(absl::Status status, absl::string_view code);

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_REQUEST_H_
