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

// A whole (non-streamed) completion or chat completion.
std::string CompletionJson(const ResponseMeta& meta, absl::string_view text,
                           absl::string_view finish_reason, const TokenUsage& usage);

// One server-sent event: "data: <json>\n\n".
std::string SseEvent(absl::string_view json);
inline constexpr char kSseDone[] = "data: [DONE]\n\n";

// A streamed chunk: `text` (completions) or delta.content (chat), with finish_reason when it is
// the last. Chat's first chunk carries delta.role = "assistant" (`first`). With include_usage
// every chunk has "usage": null, as OpenAI sends it.
std::string ChunkJson(const ResponseMeta& meta, absl::string_view text, bool first,
                      std::optional<absl::string_view> finish_reason, bool include_usage);
// The final usage chunk of include_usage: empty choices, the usage.
std::string UsageChunkJson(const ResponseMeta& meta, const TokenUsage& usage);
// An error inside a stream that already answered 200: {"error": {...}} as one event.
std::string StreamErrorEvent(const ApiError& error);

// GET /v1/models.
std::string ModelsJson(absl::string_view model, int64_t created);
// GET /version's body: {"version": version} (vLLM's).
std::string VersionJson(absl::string_view version);

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_RESPONSE_H_
