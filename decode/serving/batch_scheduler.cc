#include "decode/serving/batch_scheduler.h"

#include <algorithm>
#include <chrono>

#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "decode/serving/decode_metrics.h"

namespace fluxion::decode {
namespace {

// CPU time of the whole process (every thread, the model's worker threads included).
double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

}  // namespace

Finish AcceptToken(DecodeRequest& r, int32_t token,
                   const std::optional<model::TokenLogprobs>& logprobs) {
  r.last_token = token;
  ++r.completion_tokens;
  if (r.sampler.has_value()) r.sampler->Accept(token);  // what its penalties read
  Finish finish = Finish::kNone;
  if (std::find(r.stop_ids.begin(), r.stop_ids.end(), token) != r.stop_ids.end()) {
    finish = Finish::kStop;
  } else if (r.completion_tokens >= r.max_tokens ||
             (r.context_limit > 0 && r.seq != nullptr && r.seq->length() + 1 >= r.context_limit)) {
    finish = Finish::kLength;
  }
  absl::MutexLock lock(&r.mu);
  r.pending.push_back(token);
  if (logprobs.has_value()) r.pending_logprobs.push_back(*logprobs);
  if (finish == Finish::kStop) r.matched_stop = token;
  return finish;
}

void EndRequest(DecodeRequest& r, Finish finish, absl::Status error) {
  const double fraction = r.attention != nullptr ? r.attention->attended_fraction() : 1.0;
  const sparse::SelectionStats stats =
      r.attention != nullptr ? r.attention->stats() : sparse::SelectionStats{};
  sparse::GuardStats guard =
      r.attention != nullptr ? r.attention->guard_stats() : sparse::GuardStats{};
  r.attention = nullptr;
  r.seq.reset();  // returns the request's pages to the arena
  absl::MutexLock lock(&r.mu);
  if (r.finish == Finish::kNone) {
    r.finish = finish;
    r.error = std::move(error);
    r.read_fraction = fraction;
    r.sparse_stats = stats;
    r.guard_stats = std::move(guard);
  }
}

BatchScheduler::BatchScheduler(const model::Model* model, KvAdmission* admission,
                               int64_t growth_pages, int64_t page_tokens,
                               DecodeNodeMetrics* node_metrics, StepExecutor* executor,
                               const kernels::cpu::CpuPool* cpu_pool)
    : model_(model),
      admission_(admission),
      growth_pages_(growth_pages),
      page_tokens_(page_tokens),
      node_metrics_(node_metrics),
      owned_executor_(executor == nullptr ? NewCpuStepExecutor(model, cpu_pool) : nullptr),
      executor_(executor != nullptr ? executor : owned_executor_.get()),
      thread_([this] { Loop(); }) {}

BatchScheduler::~BatchScheduler() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
  for (auto& r : running_) End(*r, Finish::kError, absl::UnavailableError("decode node shutting down"));
  absl::MutexLock lock(&mu_);
  for (auto& r : joining_) End(*r, Finish::kError, absl::UnavailableError("decode node shutting down"));
}

void BatchScheduler::Join(std::shared_ptr<DecodeRequest> r) {
  absl::MutexLock lock(&mu_);
  joining_.push_back(std::move(r));
}

void BatchScheduler::JoinAll(std::vector<std::shared_ptr<DecodeRequest>> rs) {
  absl::MutexLock lock(&mu_);
  for (auto& r : rs) joining_.push_back(std::move(r));
}

double BatchScheduler::recent_step_ms() const {
  absl::MutexLock lock(&mu_);
  if (absl::Now() - last_step_ > absl::Seconds(10)) return 0;
  return step_ms_;
}

void BatchScheduler::End(DecodeRequest& r, Finish finish, absl::Status error) {
  // Its executor reservation and window slot go back before its pages do.
  if (r.attention != nullptr) executor_->Forget(*r.attention);
  EndRequest(r, finish, std::move(error));  // the request's reservations wake the waiters
}

std::vector<DecodeRequest*> BatchScheduler::PrepareStep() {
  // Every request of the step appends before any finishes, so the pages of all requests that
  // start a page this step must be free at once, not one request's at a time.
  std::vector<const DecodeRequest*> starting_page;
  auto pages_needed = [&]() {
    int64_t n = 1;  // the request being checked
    for (const DecodeRequest* p : starting_page) n += p->seq != nullptr;
    return n * growth_pages_;
  };
  for (size_t i = 0; i < running_.size(); ++i) {
    DecodeRequest& r = *running_[i];
    if (r.seq == nullptr) continue;  // preempted earlier in this pass
    if (r.abort.load()) {
      End(r, Finish::kAbort, absl::OkStatus());
      continue;
    }
    if (r.seq->length() % page_tokens_ != 0) continue;
    // The next token starts a page in every layer and head: make room by the rule.
    while (admission_->arena()->counters().free < pages_needed()) {
      DecodeRequest* victim = nullptr;
      for (auto& other : running_) {
        if (other->seq != nullptr &&
            (victim == nullptr || other->admission_seq > victim->admission_seq)) {
          victim = other.get();
        }
      }
      if (victim == nullptr) break;
      ++preempted_;
      const bool others_run = std::any_of(running_.begin(), running_.end(), [&](const auto& o) {
        return o.get() != victim && o->seq != nullptr;
      });
      {
        absl::MutexLock lock(&victim->mu);
        victim->preempted = true;
        victim->resumable = others_run;
      }
      End(*victim, Finish::kError,
          absl::ResourceExhaustedError(
              others_run
                  ? absl::StrCat("preempted: the KV arena ran out of pages while ",
                                 running_.size(),
                                 " requests were decoding; the youngest waits for pages and "
                                 "resumes (docs/SERVING.md)")
                  : absl::StrCat("preempted: the request outgrew the decode node's KV arena "
                                 "(", admission_->arena()->num_pages(),
                                 " pages) on its own; retry with fewer max_tokens or on a node "
                                 "with more --kv-pages")));
      if (victim == &r) break;
    }
    if (r.seq != nullptr) starting_page.push_back(&r);
  }
  std::vector<DecodeRequest*> batch;
  for (auto& r : running_) {
    if (r->seq != nullptr) batch.push_back(r.get());
  }
  return batch;
}

void BatchScheduler::RunStep(const std::vector<DecodeRequest*>& batch) {
  step_batch_.clear();
  for (DecodeRequest* r : batch) {
    model::Sampler* sampler = r->sampler.has_value() ? &*r->sampler : nullptr;
    step_batch_.push_back({r->seq.get(), r->attention, r->last_token, sampler});
  }
  const auto ts = std::chrono::steady_clock::now();
  // The executor samples: it may bring only the sampler's candidates to the host, not the logits.
  executor_->StepAndSample(step_batch_, &tokens_, &logits_, &statuses_);
  const uint64_t step_us = std::chrono::duration_cast<std::chrono::microseconds>(
                               std::chrono::steady_clock::now() - ts)
                               .count();
  for (size_t i = 0; i < batch.size(); ++i) {
    DecodeRequest& r = *batch[i];
    if (!statuses_[i].ok()) {
      End(r, Finish::kError,
          absl::Status(statuses_[i].code(),
                       absl::StrCat("decode step failed: ", statuses_[i].message())));
      continue;
    }
    const int32_t token = tokens_[i];
    if (token < 0) {  // a request joins with its sampler; one without is the node's bug
      End(r, Finish::kError, absl::InternalError("decode step: the request has no sampler"));
      continue;
    }
    {
      absl::MutexLock lock(&r.mu);
      r.max_step_us = std::max(r.max_step_us, step_us);
    }
    const Finish finish = AcceptToken(r, token, r.sampler->last_logprobs());
    if (finish != Finish::kNone) End(r, finish, absl::OkStatus());
  }
}

void BatchScheduler::Loop() {
  std::vector<std::shared_ptr<DecodeRequest>> aborted_waiting;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !joining_.empty() || !running_.empty();
      };
      mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(100));
      if (stop_) return;
      // Joiners beyond what a step can take (the hybrid executor's window slots, its
      // device-selection places) wait, first come first served: one the executor cannot hold
      // yet holds back those behind it. One aborted while waiting ends here.
      const int64_t cap = executor_->max_batch();
      size_t taken = 0;
      for (; taken < joining_.size(); ++taken) {
        if (cap > 0 && static_cast<int64_t>(running_.size()) >= cap) break;
        const SparseAttention* attention = joining_[taken]->attention;
        if (attention != nullptr && !executor_->Reserve(*attention)) break;
        running_.push_back(std::move(joining_[taken]));
      }
      joining_.erase(joining_.begin(), joining_.begin() + taken);
      auto aborted = std::stable_partition(joining_.begin(), joining_.end(),
                                           [](const auto& r) { return !r->abort.load(); });
      aborted_waiting.assign(std::make_move_iterator(aborted),
                             std::make_move_iterator(joining_.end()));
      joining_.erase(aborted, joining_.end());
    }
    // Ended outside the lock: freeing pages wakes admission, whose waiters may Join().
    for (auto& r : aborted_waiting) End(*r, Finish::kAbort, absl::OkStatus());
    aborted_waiting.clear();
    running_count_ = static_cast<int64_t>(running_.size());
    if (running_.empty()) continue;
    const auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = node_metrics_ != nullptr ? ProcessCpuSeconds() : 0.0;
    const std::vector<DecodeRequest*> batch = PrepareStep();
    if (!batch.empty()) {
      RunStep(batch);
      if (const int64_t delay_us = step_delay_us_.load(); delay_us > 0) {
        absl::SleepFor(absl::Microseconds(delay_us));
      }
    } else {
      // Every running request is still being prepared: poll instead of spinning.
      absl::SleepFor(absl::Milliseconds(1));
    }
    running_.erase(std::remove_if(running_.begin(), running_.end(),
                                  [](const auto& r) { return r->seq == nullptr; }),
                   running_.end());
    running_count_ = static_cast<int64_t>(running_.size());
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (node_metrics_ != nullptr) node_metrics_->OnStep(ms * 1e-3, ProcessCpuSeconds() - cpu0);
    absl::MutexLock lock(&mu_);
    step_ms_ = step_ms_ == 0 ? ms : 0.9 * step_ms_ + 0.1 * ms;
    last_step_ = absl::Now();
  }
}

}  // namespace fluxion::decode
