#include "cluster/openai_exchange.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cluster/finish_reason.h"

namespace fluxion::cluster::openai {

std::shared_ptr<Exchange> Exchange::Start(
    v1::DecodeService::Stub* stub, const model::Tokenizer* tokenizer, v1::GenerateRequest generate,
    const Request& request, ResponseMeta meta, model::StreamDetokenizer detokenizer,
    std::function<void()> wake, const std::shared_ptr<ExchangeSet>& set,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  const uint64_t id = set->Reserve();
  // The set learns of the destruction only once the members (the ClientContext, which holds the
  // channel) are gone.
  std::shared_ptr<Exchange> exchange(
      new Exchange(tokenizer, request, std::move(meta), std::move(detokenizer), std::move(wake)),
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

Exchange::Exchange(const model::Tokenizer* tokenizer, const Request& request, ResponseMeta meta,
                   model::StreamDetokenizer detokenizer, std::function<void()> wake)
    : tokenizer_(tokenizer),
      stream_(request.stream),
      include_usage_(request.include_usage),
      include_stop_str_(request.include_stop_str_in_output),
      stop_token_ids_(request.stop_token_ids),
      meta_(std::move(meta)),
      detokenizer_(std::move(detokenizer)),
      wake_(std::move(wake)) {}

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
    case v1::GenerateResponse::kChunk: {
      started_ = true;
      if (stream_ && first_chunk_ && meta_.endpoint == Endpoint::kChatCompletions) {
        pending_ += SseEvent(ChunkJson(meta_, "", /*first=*/true, nullptr, include_usage_));
      }
      first_chunk_ = false;
      if (!message.chunk().sparse_policy().empty()) end_.policy = message.chunk().sparse_policy();
      for (uint32_t id : message.chunk().token_ids()) {
        ++completion_tokens_;
        AppendText(detokenizer_.Add(static_cast<int32_t>(id)));
        if (detokenizer_.stopped()) {
          end_.stop_string = detokenizer_.matched_stop();
          if (include_stop_str_) AppendText(*end_.stop_string);
          Finish("stop");
          return false;
        }
      }
      WakeLocked();
      return true;
    }
    case v1::GenerateResponse::kComplete: {
      const v1::GenerateComplete& c = message.complete();
      AppendText(detokenizer_.Finish());
      if (c.has_usage()) completion_tokens_ = c.usage().completion_tokens();
      // EOS is no stop_reason (vLLM's rule): only the request's own stop token ids are.
      if (c.has_matched_stop_token_id() &&
          std::find(stop_token_ids_.begin(), stop_token_ids_.end(),
                    c.matched_stop_token_id()) != stop_token_ids_.end()) {
        end_.stop_token_id = c.matched_stop_token_id();
      }
      if (!c.sparse_policy().empty()) end_.policy = c.sparse_policy();
      end_.read_fraction = c.read_fraction();
      Finish(cluster::FinishReasonText(c.finish_reason()));
      return true;  // read on: the status follows
    }
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

void Exchange::AppendText(const std::string& text) {
  if (text.empty()) return;
  if (stream_) {
    pending_ += SseEvent(ChunkJson(meta_, text, /*first=*/false, nullptr, include_usage_));
  } else {
    text_ += text;
  }
}

void Exchange::Finish(const std::string& finish_reason) {
  end_.finish_reason = finish_reason;
  done_ = true;
  if (stream_) {
    started_ = true;
    const bool first = first_chunk_ && meta_.endpoint == Endpoint::kChatCompletions;
    first_chunk_ = false;
    pending_ += SseEvent(ChunkJson(meta_, "", first, &end_, include_usage_));
    if (include_usage_) {
      pending_ += SseEvent(UsageChunkJson(meta_, {prompt_tokens_, completion_tokens_}));
    }
    pending_ += kSseDone;
  }
  WakeLocked();
}

void Exchange::Fail(const absl::Status& status) {
  done_ = true;
  ApiError error = ErrorFromStatus(status);
  if (stream_ && started_) {
    // The 200 and earlier text are out: the error goes in the stream, as vLLM sends it.
    pending_ += StreamErrorEvent(error);
    pending_ += kSseDone;
  } else {
    error_ = std::move(error);
  }
  WakeLocked();
}

void Exchange::WakeLocked() {
  if (suspended_ && wake_ && !cancelled_) {
    suspended_ = false;
    wake_();
  }
}

bool Exchange::HeadReadyLocked() const {
  return error_.has_value() || done_ || (stream_ && started_);
}

std::optional<Exchange::Head> Exchange::HeadOrSuspend(const std::function<void()>& suspend) {
  absl::MutexLock lock(&mu_);
  if (!HeadReadyLocked()) {
    suspend();
    suspended_ = true;
    return std::nullopt;
  }
  Head head;
  if (error_) {
    head.http_status = error_->http_status;
    head.body = ErrorJson(*error_);
    head.retry_after_s = error_->retry_after_s;
  } else if (stream_) {
    head.streaming = true;
  } else {
    head.body = CompletionJson(meta_, text_, end_, {prompt_tokens_, completion_tokens_});
  }
  return head;
}

long Exchange::ReadOrSuspend(char* buf, size_t max, const std::function<void()>& suspend) {
  absl::MutexLock lock(&mu_);
  if (!pending_.empty()) {
    const size_t n = std::min(max, pending_.size());
    std::memcpy(buf, pending_.data(), n);
    pending_.erase(0, n);
    return static_cast<long>(n);
  }
  if (done_) return -1;
  suspend();
  suspended_ = true;
  return 0;
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
