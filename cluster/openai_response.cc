#include "cluster/openai_response.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster::openai {
namespace {

using Json = nlohmann::json;

// Text from the detokenizer is valid UTF-8; client-supplied strings echoed back (the model name)
// may not be, so dump replaces rather than throws.
std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

Json NullIfEmpty(const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); }

Json UsageJson(const TokenUsage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

Json Envelope(const ResponseMeta& meta, bool chunk) {
  const bool chat = meta.endpoint == Endpoint::kChatCompletions;
  return {
      {"id", meta.id},
      {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
      {"created", meta.created},
      {"model", meta.model}};
}

void AddEnd(const ChoiceEnd& end, Json* choice, Json* response) {
  (*choice)["finish_reason"] = end.finish_reason;
  if (end.stop_string) {
    (*choice)["stop_reason"] = *end.stop_string;
  } else if (end.stop_token_id) {
    (*choice)["stop_reason"] = *end.stop_token_id;
  } else {
    (*choice)["stop_reason"] = nullptr;
  }
  Json fluxion = {{"policy", NullIfEmpty(end.policy)}};
  if (end.read_fraction) fluxion["read_fraction"] = *end.read_fraction;
  (*response)["fluxion"] = fluxion;
}

// JSON has no -inf (a token the model rules out): vLLM's stand-in.
float Finite(float logprob) { return std::isfinite(logprob) ? logprob : -9999.0f; }

Json Bytes(const std::string& bytes) {
  Json out = Json::array();
  for (unsigned char c : bytes) out.push_back(static_cast<int>(c));
  return out;
}

// Completions' legacy object: parallel lists, each position's alternatives as {text: logprob}
// with its own token among them (OpenAI: "up to logprobs + 1 elements").
Json CompletionLogprobsJson(const std::vector<LogprobEntry>& entries) {
  Json tokens = Json::array(), token_logprobs = Json::array(), top = Json::array(),
       offsets = Json::array();
  for (const LogprobEntry& e : entries) {
    tokens.push_back(e.token);
    offsets.push_back(e.text_offset);
    if (!e.logprob) {
      token_logprobs.push_back(nullptr);
      top.push_back(nullptr);
      continue;
    }
    token_logprobs.push_back(Finite(*e.logprob));
    Json alternatives = Json::object();
    for (const LogprobAlternative& a : e.top) {
      if (!alternatives.contains(a.token)) alternatives[a.token] = Finite(a.logprob);
    }
    if (!alternatives.contains(e.token)) alternatives[e.token] = Finite(*e.logprob);
    top.push_back(std::move(alternatives));
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top},
          {"text_offset", offsets}};
}

// Chat's object: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}.
Json ChatLogprobsJson(const std::vector<LogprobEntry>& entries) {
  Json content = Json::array();
  for (const LogprobEntry& e : entries) {
    Json top = Json::array();
    for (const LogprobAlternative& a : e.top) {
      top.push_back({{"token", a.token}, {"logprob", Finite(a.logprob)}, {"bytes", Bytes(a.bytes)}});
    }
    content.push_back({{"token", e.token},
                       {"logprob", Finite(e.logprob.value_or(0.0f))},
                       {"bytes", Bytes(e.bytes)},
                       {"top_logprobs", top}});
  }
  return {{"content", content}};
}

Json LogprobsJson(Endpoint endpoint, const std::vector<LogprobEntry>* entries) {
  if (entries == nullptr) return nullptr;
  return endpoint == Endpoint::kChatCompletions ? ChatLogprobsJson(*entries)
                                                : CompletionLogprobsJson(*entries);
}

}  // namespace

ApiError ErrorFromStatus(const absl::Status& status) {
  ApiError e;
  e.message = std::string(status.message());
  e.param = ErrorParam(status);
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      e.http_status = 400;
      e.type = "invalid_request_error";
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      e.type = "invalid_request_error";
      e.code = "model_not_found";
      break;
    case absl::StatusCode::kUnauthenticated:
      e.http_status = 401;
      e.type = "authentication_error";
      break;
    case absl::StatusCode::kPermissionDenied:
      e.http_status = 403;
      e.type = "permission_error";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.code = "overloaded";
      e.retry_after_s = 1;
      break;
    case absl::StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "server_error";
      e.code = "unavailable";
      e.retry_after_s = 1;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "server_error";
      e.code = "timeout";
      break;
    case absl::StatusCode::kUnimplemented:
      e.http_status = 501;
      e.type = "invalid_request_error";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      break;
  }
  if (std::string code = ErrorCode(status); !code.empty()) e.code = std::move(code);
  return e;
}

std::string ErrorJson(const ApiError& error) {
  Json j = {{"error",
             {{"message", error.message},
              {"type", error.type},
              {"param", NullIfEmpty(error.param)},
              {"code", NullIfEmpty(error.code)}}}};
  return Dump(j);
}

std::string CompletionJson(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                           const TokenUsage& usage) {
  Json j = Envelope(meta, /*chunk=*/false);
  j["choices"] = Json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const std::optional<std::vector<LogprobEntry>>& logprobs = choices[i].logprobs;
    Json choice = {{"index", i},
                   {"logprobs", LogprobsJson(meta.endpoint, logprobs ? &*logprobs : nullptr)}};
    Json response;
    AddEnd(choices[i].end, &choice, &response);
    if (i == 0) j["fluxion"] = response["fluxion"];
    if (meta.endpoint == Endpoint::kChatCompletions) {
      choice["message"] = {{"role", "assistant"}, {"content", choices[i].text}};
    } else {
      choice["text"] = choices[i].text;
    }
    j["choices"].push_back(std::move(choice));
  }
  j["usage"] = UsageJson(usage);
  return Dump(j);
}

std::string SseEvent(absl::string_view json) { return absl::StrCat("data: ", json, "\n\n"); }

std::string ChunkJson(const ResponseMeta& meta, uint32_t index, absl::string_view text,
                      bool first, const ChoiceEnd* end, bool include_usage,
                      const std::vector<LogprobEntry>* logprobs) {
  Json j = Envelope(meta, /*chunk=*/true);
  Json choice = {{"index", index},
                 {"logprobs", LogprobsJson(meta.endpoint, logprobs)},
                 {"finish_reason", nullptr}};
  if (end != nullptr) AddEnd(*end, &choice, &j);
  if (meta.endpoint == Endpoint::kChatCompletions) {
    Json delta = Json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = std::string(text);
    choice["delta"] = delta;
  } else {
    choice["text"] = std::string(text);
  }
  j["choices"] = Json::array({choice});
  if (include_usage) j["usage"] = nullptr;
  return Dump(j);
}

std::string UsageChunkJson(const ResponseMeta& meta, const TokenUsage& usage) {
  Json j = Envelope(meta, /*chunk=*/true);
  j["choices"] = Json::array();
  j["usage"] = UsageJson(usage);
  return Dump(j);
}

std::string StreamErrorEvent(const ApiError& error) { return SseEvent(ErrorJson(error)); }

std::string VersionJson(absl::string_view version) {
  return Dump(Json{{"version", std::string(version)}});
}

std::string ModelsJson(absl::string_view model, int64_t created, int64_t max_model_len) {
  Json card = {{"id", std::string(model)},
               {"object", "model"},
               {"created", created},
               {"owned_by", "fluxion"}};
  if (max_model_len > 0) card["max_model_len"] = max_model_len;
  Json j = {{"object", "list"}, {"data", Json::array({card})}};
  return Dump(j);
}

}  // namespace fluxion::cluster::openai
