#include "cluster/replayer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fluxion::cluster {
namespace {

namespace v1 = ::fluxion::v1;
using Clock = std::chrono::steady_clock;

class Call;

// Shared by the dispatcher, the reactors (on gRPC threads) and the progress printer.
struct RunState {
  Clock::time_point t0;
  bool keep_output_ids = false;  // ReplayOptions::keep_output_ids; set before the first call
  absl::Mutex mu;
  std::unordered_map<Call*, std::shared_ptr<Call>> live ABSL_GUARDED_BY(mu);
  std::vector<RequestRecord> records ABSL_GUARDED_BY(mu);
  // Call objects not yet destroyed. Run() returns only at 0: a Call's ClientContext holds a
  // reference to the channel's core, and the last reference must not be dropped on a gRPC thread
  // (gRPC may crash destroying a channel from its own callback thread).
  int64_t alive ABSL_GUARDED_BY(mu) = 0;
  std::atomic<int64_t> sent{0}, finished{0}, failed{0}, tokens{0};

  double Now() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }
};

// One Generate stream. Owned by RunState::live from Start() until OnDone().
class Call : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  Call(std::shared_ptr<RunState> state, RequestRecord record, v1::GenerateRequest request)
      : state_(std::move(state)),
        record_(std::move(record)),
        request_(std::move(request)),
        context_(std::make_unique<grpc::ClientContext>()) {
    absl::MutexLock lock(&state_->mu);
    ++state_->alive;
  }

  ~Call() override {
    context_.reset();  // before the count drops, so Run() cannot outlive the context
    absl::MutexLock lock(&state_->mu);
    --state_->alive;
  }

  void Start(v1::DecodeService::Stub* stub, std::chrono::system_clock::time_point deadline) {
    context_->set_deadline(deadline);
    stub->async()->Generate(context_.get(), &request_, this);
    StartRead(&response_);
    StartCall();
  }

  void Cancel() { context_->TryCancel(); }
  // A deliberate client-side cancellation (ReplayOptions::cancel_fraction).
  void CancelOnPurpose() {
    cancel_on_purpose_.store(true);
    context_->TryCancel();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    double now = state_->Now();
    if (response_.has_chunk() && response_.chunk().token_ids_size() > 0) {
      int n = response_.chunk().token_ids_size();
      record_.chunk_times_s.push_back(now);
      record_.chunk_tokens.push_back(n);
      record_.output_tokens += n;
      if (state_->keep_output_ids) {
        const auto& ids = response_.chunk().token_ids();
        record_.output_ids.insert(record_.output_ids.end(), ids.begin(), ids.end());
      }
      state_->tokens.fetch_add(n, std::memory_order_relaxed);
    } else if (response_.has_error()) {
      error_message_ = response_.error().message();
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    record_.end_s = state_->Now();
    record_.status_code = status.error_code();
    record_.status_message = status.ok() ? "" : status.error_message();
    // A request that finished before its cancellation landed counts as finished.
    record_.cancelled_by_client = cancel_on_purpose_.load() && !status.ok();
    if (!status.ok() && record_.status_message.empty()) record_.status_message = error_message_;
    if (!status.ok() && !record_.cancelled_by_client) {
      state_->failed.fetch_add(1, std::memory_order_relaxed);
    }
    state_->finished.fetch_add(1, std::memory_order_relaxed);
    std::shared_ptr<Call> self;
    {
      absl::MutexLock lock(&state_->mu);
      state_->records.push_back(std::move(record_));
      auto it = state_->live.find(this);
      self = std::move(it->second);  // keeps *this alive until the end of this function
      state_->live.erase(it);
    }
  }

 private:
  const std::shared_ptr<RunState> state_;
  RequestRecord record_;
  v1::GenerateRequest request_;
  v1::GenerateResponse response_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::string error_message_;
  std::atomic<bool> cancel_on_purpose_{false};
};

// Cancels chosen requests a fixed time after they were sent, on its own thread.
class Canceller {
 public:
  Canceller() : thread_([this] { Loop(); }) {}
  ~Canceller() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Schedule(Clock::time_point when, std::weak_ptr<Call> call) {
    absl::MutexLock lock(&mu_);
    due_.emplace(when, std::move(call));
  }

 private:
  void Loop() {
    while (true) {
      std::vector<std::weak_ptr<Call>> now_due;
      {
        absl::MutexLock lock(&mu_);
        // Wakes every 10 ms at most: cancellation times need no finer resolution.
        mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(10));
        if (stop_) return;
        auto now = Clock::now();
        while (!due_.empty() && due_.begin()->first <= now) {
          now_due.push_back(std::move(due_.begin()->second));
          due_.erase(due_.begin());
        }
      }
      for (auto& weak : now_due) {
        if (auto call = weak.lock()) call->CancelOnPurpose();  // outside the lock
      }
    }
  }

  absl::Mutex mu_;
  std::multimap<Clock::time_point, std::weak_ptr<Call>> due_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

void PrintProgress(const RunState& state, int64_t total, bool tty, bool final_line) {
  double elapsed = state.Now();
  int64_t sent = state.sent.load(), finished = state.finished.load();
  int64_t failed = state.failed.load(), tokens = state.tokens.load();
  std::string line = absl::StrFormat(
      "replay %6.1fs  sent %lld/%lld  done %lld  failed %lld  in flight %lld  %.0f tok/s", elapsed,
      static_cast<long long>(sent), static_cast<long long>(total), static_cast<long long>(finished),
      static_cast<long long>(failed), static_cast<long long>(sent - finished),
      elapsed > 0 ? tokens / elapsed : 0.0);
  if (tty) {
    std::fprintf(stderr, "\r%s\033[K%s", line.c_str(), final_line ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

bool FiniteIn(double v, double lo, double hi) { return std::isfinite(v) && v >= lo && v <= hi; }

template <typename T>
absl::Status OutOfRange(absl::string_view flag, T value, absl::string_view range) {
  return absl::InvalidArgumentError(absl::StrCat(flag, " must be ", range, ", got ", value));
}

// The target's stub once its channel connects, or Unavailable after the connect timeout.
absl::StatusOr<std::unique_ptr<v1::DecodeService::Stub>> Connect(const ReplayOptions& o) {
  auto channel = serving::CreateChannel(o.target, o.channel);
  // gRPC deadlines are system_clock time points.
  auto connect_deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(o.connect_timeout_s * 1e3));
  if (!channel->WaitForConnected(connect_deadline)) {
    return absl::UnavailableError(absl::StrCat("replay: cannot connect to ", o.target, " within ",
                                               o.connect_timeout_s,
                                               " s (is the router or decode node running?)"));
  }
  return v1::DecodeService::NewStub(channel);
}

// The progress line's thread: a live line on a terminal twice a second; in logs, one line every
// 10 s; until `done`. `state` and `done` must outlive it (the caller joins it).
std::thread StartProgress(const RunState& state, int64_t total, bool tty,
                          const std::atomic<bool>& done) {
  return std::thread([&state, &done, total, tty] {
    const auto period = tty ? std::chrono::milliseconds(500) : std::chrono::milliseconds(10000);
    auto next = Clock::now() + period;
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (Clock::now() >= next) {
        PrintProgress(state, total, tty, false);
        next += period;
      }
    }
  });
}

// Waits for a request's turn: its arrival time (timed mode), then a free slot under
// --concurrency or --max-inflight; returns early once `interrupted`.
void WaitForTurn(RunState& state, const TraceRequest& tr, const ReplayOptions& o,
                 const std::atomic<bool>& interrupted) {
  const int64_t limit = o.concurrency > 0 ? o.concurrency : o.max_inflight;
  if (o.concurrency <= 0) {
    auto when = state.t0 + std::chrono::microseconds(static_cast<int64_t>(tr.arrival_s * 1e6));
    while (!interrupted.load() && Clock::now() < when) {
      std::this_thread::sleep_until(std::min(when, Clock::now() + std::chrono::milliseconds(100)));
    }
  }
  if (limit <= 0) return;
  std::pair<RunState*, int64_t> arg(&state, limit);
  absl::MutexLock lock(&state.mu);
  while (!interrupted.load() && static_cast<int64_t>(state.live.size()) >= limit) {
    // Woken by OnDone's unlock; the timeout only bounds how late an Interrupt() is seen.
    state.mu.AwaitWithTimeout(
        absl::Condition(
            +[](std::pair<RunState*, int64_t>* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return static_cast<int64_t>(a->first->live.size()) < a->second;
            },
            &arg),
        absl::Milliseconds(100));
  }
}

// Request `i` of the schedule as the Generate call sends it.
v1::GenerateRequest BuildRequest(const ReplayOptions& o, const TraceRequest& tr,
                                 int64_t block_tokens, int64_t i) {
  v1::GenerateRequest request;
  request.set_request_id(absl::StrCat(o.request_id_prefix, "-", i));
  for (uint32_t t : BuildPrompt(tr, block_tokens, o.vocab_size)) request.add_prompt_token_ids(t);
  v1::SamplingParams* sampling = request.mutable_sampling();
  sampling->set_max_tokens(static_cast<uint32_t>(tr.output_tokens));
  sampling->set_ignore_eos(true);  // the trace fixes the output length
  if (o.temperature.has_value()) sampling->set_temperature(*o.temperature);
  if (!o.sparse_policy.empty()) {
    request.mutable_sparse()->set_policy(o.sparse_policy);
    if (o.sparse_budget.has_value()) request.mutable_sparse()->set_budget(*o.sparse_budget);
  }
  request.set_timeout_ms(static_cast<uint32_t>(o.timeout_s * 1e3));
  request.set_protocol_version(v1::PROTOCOL_VERSION_1);
  return request;
}

// Waits until every call has finished (each has a deadline, so this ends); once `interrupted`,
// cancels what is left. Then waits until the last Call is destroyed too (see RunState::alive).
void Drain(RunState& state, const std::atomic<bool>& interrupted) {
  bool cancelled = false;
  while (true) {
    std::vector<std::shared_ptr<Call>> to_cancel;
    {
      absl::MutexLock lock(&state.mu);
      if (state.live.empty()) break;
      if (interrupted.load() && !cancelled) {
        for (auto& [ptr, call] : state.live) to_cancel.push_back(call);
        cancelled = true;
      } else {
        state.mu.AwaitWithTimeout(
            absl::Condition(
                +[](RunState* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->live.empty(); },
                &state),
            absl::Milliseconds(100));
      }
    }
    // TryCancel outside the lock: it may run OnDone, which takes the lock.
    for (auto& call : to_cancel) call->Cancel();
  }
}

void AwaitCallsDestroyed(RunState& state) {
  absl::MutexLock lock(&state.mu);
  state.mu.AwaitWithTimeout(
      absl::Condition(
          +[](RunState* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->alive == 0; }, &state),
      absl::Seconds(10));
}

}  // namespace

absl::Status ValidateReplayOptions(const ReplayOptions& o) {
  if (o.vocab_size < 2 || o.vocab_size > kMaxReplayVocabSize) {
    // Token ids are drawn from [1, vocab_size): 1 left an empty range (a division by zero).
    return OutOfRange("--vocab-size", o.vocab_size,
                      absl::StrCat("in [2, ", kMaxReplayVocabSize, "]"));
  }
  const std::string inflight_range = absl::StrCat("in [0, ", kMaxReplayInflight, "]");
  if (o.concurrency < 0 || o.concurrency > kMaxReplayInflight) {
    return OutOfRange("--concurrency", o.concurrency, inflight_range);
  }
  if (o.max_inflight < 0 || o.max_inflight > kMaxReplayInflight) {
    return OutOfRange("--max-inflight", o.max_inflight, inflight_range);
  }
  // timeout_ms travels as uint32 milliseconds (49.7 days); a week is plenty.
  if (!FiniteIn(o.timeout_s, 1e-3, kMaxReplayTimeoutS)) {
    return OutOfRange("--timeout-s", o.timeout_s,
                      absl::StrCat("in [0.001, ", kMaxReplayTimeoutS, "]"));
  }
  if (!FiniteIn(o.connect_timeout_s, 1e-3, kMaxReplayTimeoutS)) {
    return OutOfRange("connect timeout", o.connect_timeout_s,
                      absl::StrCat("in [0.001, ", kMaxReplayTimeoutS, "]"));
  }
  if (o.temperature.has_value() && !FiniteIn(*o.temperature, 0, 100)) {
    return OutOfRange("--temperature", *o.temperature, "in [0, 100]");
  }
  if (o.sparse_budget.has_value() && !(std::isfinite(*o.sparse_budget) && *o.sparse_budget > 0)) {
    return OutOfRange("--budget", *o.sparse_budget, "finite and positive");
  }
  if (!FiniteIn(o.cancel_fraction, 0, 1)) {
    return OutOfRange("--cancel-fraction", o.cancel_fraction, "in [0, 1]");
  }
  if (!FiniteIn(o.cancel_after_s, 0, kMaxReplayTimeoutS)) {
    return OutOfRange("--cancel-after-s", o.cancel_after_s,
                      absl::StrCat("in [0, ", kMaxReplayTimeoutS, "]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RequestRecord>> Replayer::Run(const Schedule& schedule) {
  if (absl::Status valid = ValidateReplayOptions(options_); !valid.ok()) return valid;
  if (schedule.block_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule block_tokens ", schedule.block_tokens, " must be at least 1"));
  }
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<v1::DecodeService::Stub> stub, Connect(options_));
  // Shared with every Call, so whichever of them finishes last can still reach it.
  auto state_ptr = std::make_shared<RunState>();
  RunState& state = *state_ptr;
  state.keep_output_ids = options_.keep_output_ids;
  const int64_t total = schedule.requests.size();
  const bool tty = isatty(STDERR_FILENO);
  std::atomic<bool> done{false};
  std::thread progress;
  if (options_.progress) progress = StartProgress(state, total, tty, done);
  std::unique_ptr<Canceller> canceller;
  if (options_.cancel_fraction > 0) canceller = std::make_unique<Canceller>();
  std::mt19937_64 cancel_rng(options_.cancel_seed);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  const auto cancel_after =
      std::chrono::microseconds(static_cast<int64_t>(options_.cancel_after_s * 1e6));
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_s * 1e3));
  state.t0 = Clock::now();
  for (int64_t i = 0; i < total && !interrupted_.load(); ++i) {
    const TraceRequest& tr = schedule.requests[i];
    WaitForTurn(state, tr, options_, interrupted_);
    if (interrupted_.load()) break;
    v1::GenerateRequest request = BuildRequest(options_, tr, schedule.block_tokens, i);
    RequestRecord record;
    record.index = i;
    record.request_id = request.request_id();
    record.scheduled_s = tr.arrival_s;
    record.input_tokens = tr.input_tokens;
    record.requested_output_tokens = tr.output_tokens;
    record.start_s = state.Now();
    auto call = std::make_shared<Call>(state_ptr, std::move(record), std::move(request));
    {
      absl::MutexLock lock(&state.mu);
      state.live.emplace(call.get(), call);
    }
    state.sent.fetch_add(1);
    // The gRPC deadline is a little later than timeout_ms so that a server that notices first can
    // still end the stream with an error carrying partial usage (docs/PROTOCOL.md).
    call->Start(stub.get(), std::chrono::system_clock::now() + timeout + std::chrono::seconds(1));
    // One draw per request, cancelled or not, so the same seed picks the same requests.
    if (canceller != nullptr && coin(cancel_rng) < options_.cancel_fraction) {
      canceller->Schedule(Clock::now() + cancel_after, call);
    }
  }
  Drain(state, interrupted_);
  canceller.reset();  // it may hold a Call for a moment; the wait below counts those too
  AwaitCallsDestroyed(state);
  done.store(true);
  if (progress.joinable()) {
    progress.join();
    PrintProgress(state, total, tty, true);
  }
  absl::MutexLock lock(&state.mu);
  std::vector<RequestRecord> records = std::move(state.records);
  std::sort(records.begin(), records.end(),
            [](const RequestRecord& a, const RequestRecord& b) { return a.index < b.index; });
  return records;
}

}  // namespace fluxion::cluster
