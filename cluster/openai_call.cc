#include "cluster/openai_call.h"

#include <ctime>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace fluxion::cluster::openai {

absl::Status CheckModel(const Preparer& preparer, const std::string& model) {
  if (model == preparer.model_name) return absl::OkStatus();
  return WithParam(absl::NotFoundError(absl::StrCat("The model `", model,
                                                    "` does not exist; this server serves `",
                                                    preparer.model_name, "`")),
                   "model");
}

model::EncodeCheck BoundedCheck(const Preparer& preparer, model::EncodeCheck cancelled) {
  // The timeout bounds the work one request may cost, whatever the tokenizer makes of its text
  // (a hostile tokenizer.json: a backtracking pattern, hundreds of thousands of added tokens).
  const absl::Time deadline = absl::Now() + preparer.tokenize_timeout;
  return [cancelled = std::move(cancelled), timeout = preparer.tokenize_timeout,
          deadline]() -> absl::Status {
    if (absl::Status s = cancelled(); !s.ok()) return s;
    if (absl::Now() < deadline) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizing the prompt took longer than ", absl::ToInt64Milliseconds(timeout),
                     " ms (--http-tokenize-timeout-ms): the text is too expensive for this model's "
                     "tokenizer; shorten or change it"));
  };
}

absl::StatusOr<Prepared> Prepare(const Preparer& preparer, Endpoint endpoint,
                                 absl::string_view body, const std::string& id,
                                 const model::EncodeCheck& cancelled) {
  auto request = ParseRequest(endpoint, body, preparer.parse_limits);
  if (!request.ok()) return request.status();
  if (absl::Status s = CheckModel(preparer, request->model); !s.ok()) return s;
  // Fields the request leaves unset take the model's shipped defaults, as vLLM applies them.
  const model::GenerationDefaults& defaults = preparer.generation_defaults;
  if (!request->temperature) request->temperature = defaults.temperature;
  if (!request->top_p) request->top_p = defaults.top_p;
  if (!request->top_k) request->top_k = defaults.top_k;
  if (!request->repetition_penalty) request->repetition_penalty = defaults.repetition_penalty;
  const model::EncodeCheck check = BoundedCheck(preparer, cancelled);
  auto choices = PrepareGenerate(*request, *preparer.tokenizer, *preparer.chat, id, check,
                                 preparer.max_context_tokens);
  if (!choices.ok()) return choices.status();
  model::StreamDetokenizerOptions detokenizer_options;
  detokenizer_options.stop = request->stop;
  detokenizer_options.skip_special = request->skip_special_tokens;
  Prepared prepared;
  for (size_t i = 0; i < choices->size(); ++i) {
    auto detokenizer = model::StreamDetokenizer::Create(preparer.tokenizer, detokenizer_options);
    if (!detokenizer.ok()) return WithParam(detokenizer.status(), "stop");
    prepared.detokenizers.push_back(std::move(*detokenizer));
  }
  prepared.meta = {endpoint, id, static_cast<int64_t>(std::time(nullptr)), request->model};
  prepared.tokenizer = preparer.tokenizer;
  if (request->echo) {
    for (const Prompt& p : request->prompts) {
      std::vector<int32_t> ids(p.ids.begin(), p.ids.end());
      prepared.echo_texts.push_back(p.text ? *p.text : preparer.tokenizer->Decode(ids, false));
    }
  }
  prepared.request = std::move(*request);
  prepared.choices = std::move(*choices);
  return prepared;
}

void CallState::Cancel(const absl::Status& why) {
  std::shared_ptr<Completion> completion;
  {
    absl::MutexLock lock(&mu_);
    if (!why_.ok() || detached_) return;
    why_ = why;
    completion = completion_;
  }
  if (completion != nullptr) completion->Abandon(why);
}

absl::Status CallState::CancelledWhy() const {
  absl::MutexLock lock(&mu_);
  return why_;
}

void CallState::Finish(const absl::Status& prepared,
                       const std::function<std::shared_ptr<Completion>()>& start) {
  absl::MutexLock lock(&mu_);
  if (!prepared.ok()) {
    outcome_ = prepared;
  } else if (!why_.ok()) {
    outcome_ = why_;
  } else {
    completion_ = start();
    outcome_ = Answer{completion_, ""};
  }
  ResumeLocked();
}

void CallState::FinishWithBody(absl::StatusOr<std::string> body) {
  absl::MutexLock lock(&mu_);
  if (!why_.ok()) {
    outcome_ = why_;
  } else if (!body.ok()) {
    outcome_ = body.status();
  } else {
    outcome_ = Answer{nullptr, *std::move(body)};
  }
  ResumeLocked();
}

void CallState::ResumeLocked() {
  if (suspended_ && !detached_) {
    suspended_ = false;
    resume_();
  }
}

std::optional<CallState::Outcome> CallState::OutcomeOrSuspend(
    const std::function<void()>& suspend) {
  absl::MutexLock lock(&mu_);
  if (outcome_.has_value()) return outcome_;
  suspend();
  suspended_ = true;
  return std::nullopt;
}

void CallState::Detach() {
  std::shared_ptr<Completion> completion;
  {
    absl::MutexLock lock(&mu_);
    detached_ = true;
    if (why_.ok()) why_ = absl::CancelledError("the HTTP request ended");
    completion = std::move(completion_);
  }
  if (completion != nullptr) completion->Cancel();
}

}  // namespace fluxion::cluster::openai
