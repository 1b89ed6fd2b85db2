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
                                                size_t index, const model::EncodeCheck& check) {
  std::vector<uint32_t> prompt;
  if (request.endpoint == Endpoint::kChatCompletions) {
    if (!chat) {
      return WithParam(
          absl::InvalidArgumentError("chat completions are not available: the router has no chat "
                                     "template for this model (use /v1/completions)"),
          "messages");
    }
    auto text = chat(request.messages, request.chat_template_kwargs);
    if (!text.ok()) return WithParam(text.status(), "messages");
    auto ids = Tokenize(*text, tokenizer, "messages", check);
    if (!ids.ok()) return ids.status();
    prompt = std::move(*ids);
  } else if (const Prompt& p = request.prompts.at(index); p.text) {
    auto ids = Tokenize(*p.text, tokenizer, "prompt", check);
    if (!ids.ok()) return ids.status();
    prompt = std::move(*ids);
  } else {
    if (absl::Status s = CheckIds(p.ids, tokenizer, "prompt"); !s.ok()) return s;
    prompt = p.ids;
  }
  return prompt;
}

namespace {

// The GenerateRequest of one choice: `prompt`, the request's sampling fields, `seed` (when the
// request gives one).
v1::GenerateRequest ChoiceRequest(const Request& request, const std::vector<uint32_t>& prompt,
                                  const std::string& request_id, std::optional<uint64_t> seed) {
  v1::GenerateRequest g;
  g.set_request_id(request_id);
  g.mutable_prompt_token_ids()->Assign(prompt.begin(), prompt.end());
  v1::SamplingParams* s = g.mutable_sampling();
  if (request.temperature) s->set_temperature(*request.temperature);
  if (request.top_p) s->set_top_p(*request.top_p);
  s->set_top_k(request.top_k.value_or(0));
  if (seed) s->set_seed(*seed);
  if (request.max_tokens) s->set_max_tokens(*request.max_tokens);
  s->mutable_stop_token_ids()->Assign(request.stop_token_ids.begin(), request.stop_token_ids.end());
  s->set_ignore_eos(request.ignore_eos);
  s->set_presence_penalty(request.presence_penalty);
  s->set_frequency_penalty(request.frequency_penalty);
  if (request.repetition_penalty && *request.repetition_penalty != 1) {
    s->set_repetition_penalty(*request.repetition_penalty);
  }
  s->set_min_tokens(request.min_tokens);
  if (request.logprobs) {
    s->set_logprobs(*request.logprobs);
    // Echoed prompts show their tokens' logprobs too, with as many alternatives.
    if (request.echo) s->set_prompt_logprobs(*request.logprobs);
  }
  if (!request.policy.empty()) g.mutable_sparse()->set_policy(request.policy);
  if (request.budget) g.mutable_sparse()->set_budget(*request.budget);
  g.set_protocol_version(v1::PROTOCOL_VERSION_1);
  return g;
}

}  // namespace

absl::StatusOr<std::vector<PreparedChoice>> PrepareGenerate(const Request& request,
                                                            const model::Tokenizer& tokenizer,
                                                            const ChatRenderer& chat,
                                                            const std::string& request_id,
                                                            const model::EncodeCheck& check,
                                                            int64_t max_context_tokens) {
  if (absl::Status s = CheckIds(request.stop_token_ids, tokenizer, "stop_token_ids"); !s.ok()) {
    return s;
  }
  const size_t prompts = PromptCount(request);
  const bool several = prompts * request.n > 1;
  std::vector<PreparedChoice> choices;
  choices.reserve(prompts * request.n);
  for (size_t p = 0; p < prompts; ++p) {
    FLUXION_ASSIGN_OR_RETURN(std::vector<uint32_t> prompt,
                             PromptIds(request, tokenizer, chat, p, check));
    if (max_context_tokens > 0) {
      FLUXION_RETURN_IF_ERROR(CheckContextLength(request.endpoint,
                                                 static_cast<int64_t>(prompt.size()),
                                                 request.max_tokens, max_context_tokens));
    }
    for (uint32_t j = 0; j < request.n; ++j) {
      const size_t index = p * request.n + j;
      // A seeded request stays reproducible, and its n samples of one prompt still differ.
      std::optional<uint64_t> seed;
      if (request.seed) seed = *request.seed + j;
      choices.push_back(
          {ChoiceRequest(request, prompt,
                         several ? absl::StrCat(request_id, ".", index) : request_id, seed),
           p});
    }
  }
  return choices;
}

}  // namespace fluxion::cluster::openai
