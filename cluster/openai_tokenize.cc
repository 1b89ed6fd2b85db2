#include "cluster/openai_tokenize.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "cluster/openai_generate.h"
#include "cluster/openai_request.h"
#include "common/status_macros.h"
#include "model/json_text.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster::openai {
namespace {

using Json = nlohmann::json;

absl::Status Invalid(absl::string_view param, absl::string_view message) {
  return WithParam(absl::InvalidArgumentError(message), param);
}

absl::StatusOr<Json> ParseBody(const Preparer& preparer, absl::string_view body) {
  model::JsonTextOptions options;
  options.max_depth = preparer.parse_limits.max_depth;
  options.reject_duplicate_top_level_keys = true;
  FLUXION_ASSIGN_OR_RETURN(Json json, model::ParseJsonText(body, "the request body", options));
  if (!json.is_object()) return absl::InvalidArgumentError("the request body must be a JSON object");
  if (json.contains("model")) {
    if (!json["model"].is_string()) return Invalid("model", "model must be a string");
    FLUXION_RETURN_IF_ERROR(CheckModel(preparer, json["model"].get<std::string>()));
  }
  return json;
}

// A vLLM field this server honours at one value only: null or `fixed`, else 400 saying why.
absl::Status OnlyValue(const Json& v, const char* name, bool fixed, absl::string_view why) {
  if (v.is_null() || (v.is_boolean() && v.get<bool>() == fixed)) return absl::OkStatus();
  return Invalid(name, absl::StrCat(name, " must be ", fixed ? "true" : "false", ": ", why));
}

// The /tokenize body as a completions or chat request of the served model, for PromptIds.
absl::StatusOr<Request> AsPromptRequest(const Preparer& preparer, const Json& json) {
  Json request = {{"model", preparer.model_name}};
  for (const auto& [key, value] : json.items()) {
    if (key == "model") continue;
    if (key == "prompt" || key == "messages") {
      request[key] = value;
    } else if (key == "add_special_tokens") {
      FLUXION_RETURN_IF_ERROR(OnlyValue(value, "add_special_tokens", false,
                                        "prompts are tokenized as /v1/completions does, with "
                                        "nothing added (chat prompts carry the template's)"));
    } else if (key == "add_generation_prompt") {
      FLUXION_RETURN_IF_ERROR(OnlyValue(value, "add_generation_prompt", true,
                                        "the chat template always ends with the assistant's turn"));
    } else if (key == "return_token_strs") {
      FLUXION_RETURN_IF_ERROR(OnlyValue(value, "return_token_strs", false,
                                        "token strings are not returned (/detokenize has the text)"));
    } else {
      return Invalid(key, absl::StrCat("Unrecognized request argument supplied: ", key));
    }
  }
  if (request.contains("prompt") == request.contains("messages")) {
    return Invalid("prompt", "give exactly one of prompt and messages");
  }
  const Endpoint endpoint =
      request.contains("prompt") ? Endpoint::kCompletions : Endpoint::kChatCompletions;
  return ParseRequest(endpoint, request.dump(), preparer.parse_limits);
}

}  // namespace

absl::StatusOr<std::string> TokenizeAnswer(const Preparer& preparer, absl::string_view body,
                                           const model::EncodeCheck& cancelled) {
  FLUXION_ASSIGN_OR_RETURN(Json json, ParseBody(preparer, body));
  FLUXION_ASSIGN_OR_RETURN(Request request, AsPromptRequest(preparer, json));
  if (PromptCount(request) != 1) return Invalid("prompt", "give one prompt to tokenize");
  FLUXION_ASSIGN_OR_RETURN(std::vector<uint32_t> ids,
                           PromptIds(request, *preparer.tokenizer, *preparer.chat, 0,
                                     BoundedCheck(preparer, cancelled)));
  Json answer = {{"count", ids.size()},
                 {"max_model_len", preparer.max_context_tokens},
                 {"tokens", ids},
                 {"token_strs", nullptr}};
  return answer.dump();
}

absl::StatusOr<std::string> DetokenizeAnswer(const Preparer& preparer, absl::string_view body) {
  FLUXION_ASSIGN_OR_RETURN(Json json, ParseBody(preparer, body));
  std::vector<int32_t> ids;
  bool has_tokens = false;
  for (const auto& [key, value] : json.items()) {
    if (key == "model") continue;
    if (key != "tokens") {
      return Invalid(key, absl::StrCat("Unrecognized request argument supplied: ", key));
    }
    has_tokens = true;
    if (!value.is_array() || value.size() > preparer.parse_limits.max_prompt_ids) {
      return Invalid("tokens", absl::StrCat("tokens must be an array of at most ",
                                            preparer.parse_limits.max_prompt_ids, " token ids"));
    }
    const int64_t vocab = preparer.tokenizer->vocab_size();
    for (const Json& id : value) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab) {
        return Invalid("tokens", absl::StrCat("tokens holds ", id.dump(),
                                              ", not a token id in [0, ", vocab, ")"));
      }
      ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
  }
  if (!has_tokens) return Invalid("tokens", "tokens is required");
  return Json{{"prompt", preparer.tokenizer->Decode(ids, /*skip_special=*/false)}}.dump(
      -1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace fluxion::cluster::openai
