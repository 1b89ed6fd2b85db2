#include "cluster/openai_completion.h"

#include <algorithm>
#include <cstring>
#include <set>

namespace fluxion::cluster::openai {

std::shared_ptr<Completion> Completion::Start(
    v1::DecodeService::Stub* stub, Prepared prepared, std::function<void()> wake,
    const std::shared_ptr<ExchangeSet>& set,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::shared_ptr<Completion> completion(new Completion(prepared, std::move(wake)));
  Completion* raw = completion.get();  // outlives its choices' wakes: ~Completion cancels them
  const Request& request = prepared.request;
  for (size_t i = 0; i < prepared.choices.size(); ++i) {
    Exchange::Options options;
    options.index = static_cast<uint32_t>(i);
    options.stream = request.stream;
    options.include_stop_str = request.include_stop_str_in_output;
    options.include_usage = request.include_usage;
    options.stop_token_ids = request.stop_token_ids;
    options.logprobs = request.logprobs;
    options.tokenizer = prepared.tokenizer;
    if (request.echo) options.echo = prepared.echo_texts.at(prepared.choices[i].prompt);
    completion->prompt_of_.push_back(prepared.choices[i].prompt);
    completion->choices_.push_back(Exchange::Start(
        stub, std::move(prepared.choices[i].generate), std::move(options), prepared.meta,
        std::move(prepared.detokenizers[i]), [raw] { raw->OnNews(); }, set, metadata));
  }
  return completion;
}

Completion::Completion(const Prepared& prepared, std::function<void()> wake)
    : stream_(prepared.request.stream),
      include_usage_(prepared.request.include_usage),
      meta_(prepared.meta),
      wake_(std::move(wake)) {}

Completion::~Completion() {
  for (const std::shared_ptr<Exchange>& choice : choices_) choice->Cancel();
}

uint64_t Completion::News() {
  absl::MutexLock lock(&mu_);
  return news_;
}

void Completion::OnNews() {
  absl::MutexLock lock(&mu_);
  ++news_;
  if (suspended_ && wake_) {
    suspended_ = false;
    wake_();
  }
}

bool Completion::SuspendUnlessNews(uint64_t seen, const std::function<void()>& suspend) {
  absl::MutexLock lock(&mu_);
  if (news_ != seen) return false;
  suspend();
  suspended_ = true;
  return true;
}

Completion::Poll Completion::PollChoices() {
  Poll poll;
  for (const std::shared_ptr<Exchange>& choice : choices_) {
    Exchange::Progress p = choice->Poll(&out_);
    poll.any_started |= p.started;
    poll.all_done &= p.done;
    if (p.error && !poll.error) poll.error = std::move(p.error);
  }
  return poll;
}

void Completion::CancelChoices() {
  for (const std::shared_ptr<Exchange>& choice : choices_) choice->Cancel();
}

TokenUsage Completion::Usage() {
  TokenUsage usage;
  std::set<size_t> counted;  // a prompt's tokens count once, however many choices continue it
  for (size_t i = 0; i < choices_.size(); ++i) {
    const ChoiceOutput out = choices_[i]->Output();
    if (counted.insert(prompt_of_[i]).second) usage.prompt_tokens += out.prompt_tokens;
    usage.completion_tokens += out.completion_tokens;
  }
  return usage;
}

Completion::Head Completion::WholeBody() {
  std::vector<ChoiceOutput> outputs;
  outputs.reserve(choices_.size());
  for (const std::shared_ptr<Exchange>& choice : choices_) outputs.push_back(choice->Output());
  Head head;
  head.body = CompletionJson(meta_, outputs, Usage());
  return head;
}

std::optional<Completion::Head> Completion::HeadOrSuspend(const std::function<void()>& suspend) {
  while (true) {
    const uint64_t seen = News();
    Poll poll = PollChoices();
    if (poll.error) {
      out_.clear();  // the status line carries the error: no event goes out
      CancelChoices();
      Head head;
      head.http_status = poll.error->http_status;
      head.body = ErrorJson(*poll.error);
      head.retry_after_s = poll.error->retry_after_s;
      return head;
    }
    if (stream_ && (poll.any_started || poll.all_done)) {
      Head head;
      head.streaming = true;
      return head;
    }
    if (!stream_ && poll.all_done) return WholeBody();
    if (SuspendUnlessNews(seen, suspend)) return std::nullopt;
  }
}

long Completion::ReadOrSuspend(char* buf, size_t max, const std::function<void()>& suspend) {
  while (true) {
    if (!out_.empty()) {
      const size_t n = std::min(max, out_.size());
      std::memcpy(buf, out_.data(), n);
      out_.erase(0, n);
      return static_cast<long>(n);
    }
    if (tail_) return -1;
    const uint64_t seen = News();
    Poll poll = PollChoices();
    if (poll.error && !failed_) {
      failed_ = true;  // its error event is in out_; the stream ends after it
      CancelChoices();
    }
    if (!out_.empty()) continue;
    if (poll.all_done || failed_) {
      if (include_usage_ && !failed_) out_ += SseEvent(UsageChunkJson(meta_, Usage()));
      out_ += kSseDone;
      tail_ = true;
      continue;
    }
    if (SuspendUnlessNews(seen, suspend)) return 0;
  }
}

void Completion::Cancel() {
  {
    absl::MutexLock lock(&mu_);
    wake_ = nullptr;
  }
  CancelChoices();
}

void Completion::Abandon(const absl::Status& why) {
  for (const std::shared_ptr<Exchange>& choice : choices_) choice->Abandon(why);
}

}  // namespace fluxion::cluster::openai
