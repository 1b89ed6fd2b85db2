// The OpenAI-compatible HTTP API's response bodies (docs/PROTOCOL.md, "OpenAI-compatible HTTP
// API"): the error object, whole completions, server-sent-event chunks and the model list, in
// the shapes OpenAI's API reference gives and its SDKs parse.
//
// Thread-safe: pure functions.
#ifndef FLUXION_CLUSTER_OPENAI_RESPONSE_H_
#define FLUXION_CLUSTER_OPENAI_RESPONSE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cluster/openai_request.h"

namespace fluxion::cluster::openai {

// OpenAI's error object: {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int http_status = 500;
  std::string message;
  std::string type;   // "invalid_request_error", "server_error", ...
  std::string param;  // the field it is about; null in JSON when empty
  std::string code;   // a machine-readable reason; null in JSON when empty
  // Seconds for the Retry-After header (429 / 503); 0: none.
  int retry_after_s = 0;
};

// The HTTP answer for a failed request: the status code follows the canonical code
// (INVALID_ARGUMENT -> 400, RESOURCE_EXHAUSTED -> 429, UNAVAILABLE -> 503 with Retry-After, ...),
// `param` from ErrorParam(status).
ApiError ErrorFromStatus(const absl::Status& status);
std::string ErrorJson(const ApiError& error);

// What every body of one response shares.
struct ResponseMeta {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
};

struct TokenUsage {
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
};

// How a choice ended.
struct ChoiceEnd {
  std::string finish_reason;  // "stop", "length", "abort"
  // vLLM's `stop_reason`: the stop string, or the request's stop token id, that ended the choice;
  // null when neither did (EOS, max_tokens).
  std::optional<std::string> stop_string;
  std::optional<uint32_t> stop_token_id;
  // Fluxion's extension, the top-level "fluxion" object: the attention policy that served the
  // request (GenerateChunk / GenerateComplete sparse_policy; empty: none was reported) and the
  // share of the context its steps read (absent when the decode node's answer was not read).
  std::string policy;
  std::optional<float> read_fraction;
};

// One token's log-probabilities as an answer shows them (openai_logprobs.h makes them).
struct LogprobAlternative {
  std::string token;  // its text
  std::string bytes;  // its raw bytes (a byte-level token may hold part of a character)
  float logprob = 0;
};
struct LogprobEntry {
  std::string token;
  std::string bytes;
  std::optional<float> logprob;  // none for an echoed prompt's first token, which has none
  std::vector<LogprobAlternative> top;  // most likely first
  // Completions: where the token's text starts in the choice's text, in code points.
  int64_t text_offset = 0;
};

// What one choice answers with, once it ended without an error.
struct ChoiceOutput {
  std::string text;
  ChoiceEnd end;
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  // With logprobs: one entry per token of `text` (echoed prompt tokens first).
  std::optional<std::vector<LogprobEntry>> logprobs;
};

// A whole (non-streamed) completion or chat completion: `choices` in index order, the "fluxion"
// object from the first (one request, one policy), `usage` the request's.
std::string CompletionJson(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                           const TokenUsage& usage);

// One server-sent event: "data: <json>\n\n".
std::string SseEvent(absl::string_view json);
inline constexpr char kSseDone[] = "data: [DONE]\n\n";

// A streamed chunk: `text` (completions) or delta.content (chat); the last one carries `end`
// (finish_reason, stop_reason, the "fluxion" object). Chat's first chunk carries delta.role =
// "assistant" (`first`). With include_usage every chunk has "usage": null, as OpenAI sends it.
// `logprobs` (may be null: "logprobs": null) are the tokens whose text the chunk carries.
std::string ChunkJson(const ResponseMeta& meta, uint32_t index, absl::string_view text,
                      bool first, const ChoiceEnd* end, bool include_usage,
                      const std::vector<LogprobEntry>* logprobs = nullptr);
// The final usage chunk of include_usage: empty choices, the usage.
std::string UsageChunkJson(const ResponseMeta& meta, const TokenUsage& usage);
// An error inside a stream that already answered 200: {"error": {...}} as one event.
std::string StreamErrorEvent(const ApiError& error);

// GET /v1/models; `max_model_len` (vLLM's field: the context a request may reach) when > 0.
std::string ModelsJson(absl::string_view model, int64_t created, int64_t max_model_len = 0);
// GET /version's body: {"version": version} (vLLM's).
std::string VersionJson(absl::string_view version);

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_RESPONSE_H_
