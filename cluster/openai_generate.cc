#include "cluster/openai_generate.h"

#include "absl/strings/str_cat.h"
#include "common/context_length.h"
#include "common/status_macros.h"

namespace fluxion::cluster::openai {
namespace {

absl::Status CheckIds(const std::vector<uint32_t>& ids, const model::Tokenizer& tokenizer,
                      const char* param) {
  const auto vocab = static_cast<uint32_t>(tokenizer.vocab_size());
  for (uint32_t id : ids) {
    if (id >= vocab) {
      return WithParam(
          absl::InvalidArgumentError(absl::StrCat(param, " holds token id ", id,
                                                  ", outside the vocabulary [0, ", vocab, ")")),
          param);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint32_t>> Tokenize(const std::string& text,
                                               const model::Tokenizer& tokenizer, const char* param,
                                               const model::EncodeCheck& check) {
  auto ids = tokenizer.EncodeChecked(text, check);
  if (!ids.ok()) return WithParam(ids.status(), param);
  if (ids->empty()) {
    return WithParam(absl::InvalidArgumentError(absl::StrCat(param, " has no tokens")), param);
  }
  return std::vector<uint32_t>(ids->begin(), ids->end());
}

}  // namespace

absl::Status CheckContextLength(Endpoint endpoint, int64_t prompt_tokens,
                                std::optional<uint32_t> max_tokens, int64_t max_context_tokens) {
  const bool chat = endpoint == Endpoint::kChatCompletions;
  const char* field = chat ? "messages" : "prompt";
  auto refuse = [&](std::string message) {
    return WithCode(WithParam(absl::InvalidArgumentError(std::move(message)), field),
                    "context_length_exceeded");
  };
  // At least one token must follow the prompt.
  if (prompt_tokens >= max_context_tokens) {
    return refuse(PromptTooLongMessage(max_context_tokens, prompt_tokens, field));
  }
  if (max_tokens.has_value() && prompt_tokens + *max_tokens > max_context_tokens) {
    return refuse(RequestTooLongMessage(max_context_tokens, prompt_tokens, *max_tokens, field));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint32_t>> PromptIds(const Request& request,
                                                const model::Tokenizer& tokenizer,
                                                const ChatRenderer& chat,
                                                const model::EncodeCheck& check) {
  std::vector<uint32_t> prompt;
  if (request.endpoint == Endpoint::kChatCompletions) {
    if (!chat) {
      return WithParam(
          absl::InvalidArgumentError("chat completions are not available: the router has no chat "
                                     "template for this model (use /v1/completions)"),
          "messages");
    }
    auto text = chat(request.messages);
    if (!text.ok()) return WithParam(text.status(), "messages");
    auto ids = Tokenize(*text, tokenizer, "messages", check);
    if (!ids.ok()) return ids.status();
    prompt = std::move(*ids);
  } else if (request.prompt_text) {
    auto ids = Tokenize(*request.prompt_text, tokenizer, "prompt", check);
    if (!ids.ok()) return ids.status();
    prompt = std::move(*ids);
  } else {
    if (absl::Status s = CheckIds(request.prompt_ids, tokenizer, "prompt"); !s.ok()) return s;
    prompt = request.prompt_ids;
  }
  return prompt;
}

absl::StatusOr<v1::GenerateRequest> PrepareGenerate(const Request& request,
                                                    const model::Tokenizer& tokenizer,
                                                    const ChatRenderer& chat,
                                                    const std::string& request_id,
                                                    const model::EncodeCheck& check,
                                                    int64_t max_context_tokens) {
  FLUXION_ASSIGN_OR_RETURN(std::vector<uint32_t> prompt,
                           PromptIds(request, tokenizer, chat, check));
  if (absl::Status s = CheckIds(request.stop_token_ids, tokenizer, "stop_token_ids"); !s.ok()) {
    return s;
  }
  if (max_context_tokens > 0) {
    FLUXION_RETURN_IF_ERROR(CheckContextLength(request.endpoint,
                                               static_cast<int64_t>(prompt.size()),
                                               request.max_tokens, max_context_tokens));
  }
  v1::GenerateRequest g;
  g.set_request_id(request_id);
  g.mutable_prompt_token_ids()->Assign(prompt.begin(), prompt.end());
  v1::SamplingParams* s = g.mutable_sampling();
  if (request.temperature) s->set_temperature(*request.temperature);
  if (request.top_p) s->set_top_p(*request.top_p);
  s->set_top_k(request.top_k);
  if (request.seed) s->set_seed(*request.seed);
  if (request.max_tokens) s->set_max_tokens(*request.max_tokens);
  s->mutable_stop_token_ids()->Assign(request.stop_token_ids.begin(), request.stop_token_ids.end());
  s->set_ignore_eos(request.ignore_eos);
  if (!request.policy.empty()) g.mutable_sparse()->set_policy(request.policy);
  if (request.budget) g.mutable_sparse()->set_budget(*request.budget);
  g.set_protocol_version(v1::PROTOCOL_VERSION_1);
  return g;
}

}  // namespace fluxion::cluster::openai
