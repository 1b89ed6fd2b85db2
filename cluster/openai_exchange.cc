#include "cluster/openai_exchange.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cluster/finish_reason.h"

namespace fluxion::cluster::openai {

std::shared_ptr<Exchange> Exchange::Start(
    v1::DecodeService::Stub* stub, v1::GenerateRequest generate, Options options,
    ResponseMeta meta, model::StreamDetokenizer detokenizer, std::function<void()> wake,
    const std::shared_ptr<ExchangeSet>& set,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  const uint64_t id = set->Reserve();
  // The set learns of the destruction only once the members (the ClientContext, which holds the
  // channel) are gone.
  std::shared_ptr<Exchange> exchange(
      new Exchange(std::move(options), std::move(meta), std::move(detokenizer), std::move(wake)),
      [set, id](Exchange* e) {
        delete e;
        set->Remove(id);
      });
  set->Add(id, exchange);
  for (const auto& [key, value] : metadata) exchange->context_.AddMetadata(key, value);
  exchange->generate_ = std::move(generate);
  exchange->prompt_tokens_ = static_cast<uint32_t>(exchange->generate_.prompt_token_ids_size());
  exchange->self_ = exchange;
  stub->async()->Generate(&exchange->context_, &exchange->generate_, exchange.get());
  exchange->StartRead(&exchange->message_);
  exchange->StartCall();
  return exchange;
}

Exchange::Exchange(Options options, ResponseMeta meta, model::StreamDetokenizer detokenizer,
                   std::function<void()> wake)
    : options_(std::move(options)),
      meta_(std::move(meta)),
      detokenizer_(std::move(detokenizer)),
      wake_(std::move(wake)) {
  if (options_.logprobs.has_value() && options_.tokenizer != nullptr) {
    track_.emplace(options_.tokenizer);
  }
}

void Exchange::OnReadDone(bool ok) {
  if (!ok) return;  // the stream ended: OnDone follows
  bool more;
  {
    absl::MutexLock lock(&mu_);
    more = Handle(message_);
  }
  if (more) {
    StartRead(&message_);
  } else {
    // A stop string matched: nothing after it may be sent, so the generation is cancelled (the
    // router cancels the decode node's stream, which frees the request's pages at once).
    context_.TryCancel();
  }
}

void Exchange::OnDone(const grpc::Status& status) {
  std::shared_ptr<Exchange> keep;  // released after the lock, possibly the last owner
  {
    absl::MutexLock lock(&mu_);
    if (!done_) {
      if (cancelled_) {
        done_ = true;
      } else if (!abandoned_.ok()) {
        Fail(abandoned_);
      } else if (status.ok()) {
        Fail(absl::InternalError("the router's stream ended without a terminal message"));
      } else {
        Fail(absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message()));
      }
    }
    keep = std::move(self_);
  }
}

bool Exchange::Handle(const v1::GenerateResponse& message) {
  if (done_) return false;
  switch (message.kind_case()) {
    case v1::GenerateResponse::kChunk:
      HandleChunk(message.chunk());
      return !done_;
    case v1::GenerateResponse::kComplete:
      HandleComplete(message.complete());
      return true;  // read on: the status follows
    case v1::GenerateResponse::kError: {
      const v1::GenerateError& e = message.error();
      Fail(absl::Status(static_cast<absl::StatusCode>(e.code()), e.message()));
      return true;
    }
    default:
      Fail(absl::InternalError("the router sent an empty GenerateResponse"));
      return true;
  }
}

void Exchange::HandleChunk(const v1::GenerateChunk& chunk) {
  started_ = true;
  if (options_.stream && first_chunk_ && meta_.endpoint == Endpoint::kChatCompletions) {
    events_ += SseEvent(
        ChunkJson(meta_, options_.index, "", /*first=*/true, nullptr, options_.include_usage));
  }
  const bool first = first_chunk_;
  first_chunk_ = false;
  if (first && options_.echo.has_value() && !Echo(chunk)) return;
  if (!chunk.sparse_policy().empty()) end_.policy = chunk.sparse_policy();
  if (track_.has_value() && chunk.logprobs_size() != chunk.token_ids_size()) {
    Fail(absl::InternalError(absl::StrCat("the decode node sent ", chunk.logprobs_size(),
                                          " logprobs for ", chunk.token_ids_size(), " tokens")));
    return;
  }
  for (int k = 0; k < chunk.token_ids_size(); ++k) {
    const uint32_t id = chunk.token_ids(k);
    ++completion_tokens_;
    if (track_.has_value()) logprobs_.push_back(track_->Add(id, &chunk.logprobs(k)));
    AppendText(detokenizer_.Add(static_cast<int32_t>(id)));
    if (detokenizer_.stopped()) {
      end_.stop_string = detokenizer_.matched_stop();
      if (options_.include_stop_str) AppendText(*end_.stop_string);
      Finish("stop");
      return;
    }
  }
  WakeLocked();
}

void Exchange::HandleComplete(const v1::GenerateComplete& c) {
  AppendText(detokenizer_.Finish());
  if (c.has_usage()) completion_tokens_ = c.usage().completion_tokens();
  // EOS is no stop_reason (vLLM's rule): only the request's own stop token ids are.
  const std::vector<uint32_t>& stops = options_.stop_token_ids;
  if (c.has_matched_stop_token_id() &&
      std::find(stops.begin(), stops.end(), c.matched_stop_token_id()) != stops.end()) {
    end_.stop_token_id = c.matched_stop_token_id();
  }
  if (!c.sparse_policy().empty()) end_.policy = c.sparse_policy();
  end_.read_fraction = c.read_fraction();
  Finish(cluster::FinishReasonText(c.finish_reason()));
}

bool Exchange::Echo(const v1::GenerateChunk& chunk) {
  if (track_.has_value()) {
    const int n = generate_.prompt_token_ids_size();
    if (chunk.prompt_logprobs_size() != n - 1) {
      Fail(absl::InternalError(absl::StrCat("the decode node sent ", chunk.prompt_logprobs_size(),
                                            " prompt logprobs for ", n, " prompt tokens")));
      return false;
    }
    for (int i = 0; i < n; ++i) {
      logprobs_.push_back(track_->Add(generate_.prompt_token_ids(i),
                                      i == 0 ? nullptr : &chunk.prompt_logprobs(i - 1)));
    }
  }
  AppendText(*options_.echo);
  return true;
}

const std::vector<LogprobEntry>* Exchange::PendingLogprobs() {
  if (!track_.has_value() || logprobs_.empty()) return nullptr;
  sent_logprobs_.clear();
  sent_logprobs_.swap(logprobs_);
  return &sent_logprobs_;
}

void Exchange::AppendText(const std::string& text) {
  if (text.empty()) return;
  if (options_.stream) {
    events_ += SseEvent(ChunkJson(meta_, options_.index, text, /*first=*/false, nullptr,
                                  options_.include_usage, PendingLogprobs()));
  } else {
    text_ += text;
  }
}

void Exchange::Finish(const std::string& finish_reason) {
  end_.finish_reason = finish_reason;
  done_ = true;
  if (options_.stream) {
    started_ = true;
    const bool first = first_chunk_ && meta_.endpoint == Endpoint::kChatCompletions;
    first_chunk_ = false;
    events_ += SseEvent(ChunkJson(meta_, options_.index, "", first, &end_, options_.include_usage,
                                  PendingLogprobs()));
  }
  WakeLocked();
}

void Exchange::Fail(const absl::Status& status) {
  done_ = true;
  error_ = ErrorFromStatus(status);
  // Once the 200 is out the error goes in the stream, as vLLM sends it; the completion drops the
  // event when the failure decides the status line instead.
  if (options_.stream) events_ += StreamErrorEvent(*error_);
  WakeLocked();
}

void Exchange::WakeLocked() {
  if (armed_ && wake_ && !cancelled_) {
    armed_ = false;
    wake_();
  }
}

Exchange::Progress Exchange::Poll(std::string* events) {
  absl::MutexLock lock(&mu_);
  events->append(events_);
  events_.clear();
  if (!done_) armed_ = true;
  return {started_, done_, error_};
}

ChoiceOutput Exchange::Output() {
  absl::MutexLock lock(&mu_);
  ChoiceOutput out{text_, end_, prompt_tokens_, completion_tokens_, std::nullopt};
  if (track_.has_value()) out.logprobs = logprobs_;
  return out;
}

void Exchange::Abandon(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (abandoned_.ok()) abandoned_ = why;
  }
  context_.TryCancel();
}

void Exchange::Cancel() {
  bool running;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    wake_ = nullptr;
    running = !done_;
  }
  if (running) context_.TryCancel();
}

uint64_t ExchangeSet::Reserve() {
  absl::MutexLock lock(&mu_);
  return next_++;
}

void ExchangeSet::Add(uint64_t id, std::weak_ptr<Exchange> exchange) {
  absl::MutexLock lock(&mu_);
  alive_.emplace(id, std::move(exchange));
}

void ExchangeSet::Remove(uint64_t id) {
  absl::MutexLock lock(&mu_);
  alive_.erase(id);
}

void ExchangeSet::CancelAll(const absl::Status& why) {
  std::vector<std::shared_ptr<Exchange>> alive;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, weak] : alive_) {
      if (auto e = weak.lock()) alive.push_back(std::move(e));
    }
  }
  for (auto& e : alive) e->Abandon(why);
}

void ExchangeSet::AwaitEmpty() {
  absl::MutexLock lock(&mu_);
  auto empty = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return alive_.empty(); };
  mu_.Await(absl::Condition(&empty));
}

}  // namespace fluxion::cluster::openai
