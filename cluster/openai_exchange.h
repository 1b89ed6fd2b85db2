// One choice of an OpenAI HTTP request in flight (a Completion holds one per choice): its
// Generate call to the router's own DecodeService (over the gRPC server's in-process channel, so
// routing, retries, shedding, deadlines and cancellation are the router's one implementation),
// the streaming detokenizer with the request's stop strings, and the choice's output so far.
//
// The completion polls it (Poll, under the exchange's lock) and, when nothing is new, the poll
// arms `wake`: the exchange runs it, once, at its next news. So a wake can never be lost between
// a poll and the completion's suspend.
//
// Thread-safe. Owned by shared_ptr: by its completion, and by itself while its call runs; an
// ExchangeSet knows each one until it is destroyed.
#ifndef FLUXION_CLUSTER_OPENAI_EXCHANGE_H_
#define FLUXION_CLUSTER_OPENAI_EXCHANGE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "cluster/openai_logprobs.h"
#include "cluster/openai_request.h"
#include "cluster/openai_response.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "model/stream_detokenizer.h"
#include "model/tokenizer.h"

namespace fluxion::cluster::openai {

class ExchangeSet;

class Exchange : public grpc::ClientReadReactor<v1::GenerateResponse>,
                 public std::enable_shared_from_this<Exchange> {
 public:
  // How the choice answers: its index among the completion's choices, and the request's output
  // options.
  struct Options {
    uint32_t index = 0;
    bool stream = false;
    bool include_stop_str = false;          // include_stop_str_in_output
    bool include_usage = false;             // "usage": null in each chunk (stream_options)
    std::vector<uint32_t> stop_token_ids;   // the request's, for stop_reason
    // The request's logprobs (absent: none), shown with `tokenizer`'s texts.
    std::optional<uint32_t> logprobs;
    const model::Tokenizer* tokenizer = nullptr;  // needed with logprobs
    // Completions' echo: the prompt's text, answered before the completion's (with logprobs,
    // its tokens' entries first; the GenerateRequest then asks for prompt_logprobs).
    std::optional<std::string> echo;
  };
  // Starts the call. `stub` must outlive the exchange; `wake` is called (from a gRPC thread,
  // under the exchange's lock, so it must not call back in) once after a Poll that found nothing
  // new. `metadata` goes with the Generate call (HTTP headers the router reads, e.g. the
  // gateway's prefill pick: cluster/prefill_pick.h); keys lowercase. `set` holds the exchange
  // until it is destroyed.
  static std::shared_ptr<Exchange> Start(
      v1::DecodeService::Stub* stub, v1::GenerateRequest generate, Options options,
      ResponseMeta meta, model::StreamDetokenizer detokenizer, std::function<void()> wake,
      const std::shared_ptr<ExchangeSet>& set,
      const std::vector<std::pair<std::string, std::string>>& metadata = {});

  // Where the choice stands.
  struct Progress {
    bool started = false;            // a chunk came
    bool done = false;               // nothing more will come
    std::optional<ApiError> error;   // it failed (streaming: its error event is in the events)
  };
  // Moves the server-sent events made since the last poll to the end of `*events` (streaming)
  // and says where the choice stands; unless done, arms the wake.
  Progress Poll(std::string* events);
  // Not streaming, once done without an error: the choice's answer.
  ChoiceOutput Output();

  // The client went away (or a sibling choice failed): cancels the call, which the router relays
  // to the decode node; no wake after this.
  void Cancel();
  // The client hung up, or the server stops: cancels the call but still wakes the completion,
  // which then answers (or ends its stream) with `why`.
  void Abandon(const absl::Status& why);

  // grpc::ClientReadReactor
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  Exchange(Options options, ResponseMeta meta, model::StreamDetokenizer detokenizer,
           std::function<void()> wake);
  // Handles one message; false when no more should be read (a stop string matched).
  bool Handle(const v1::GenerateResponse& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleChunk(const v1::GenerateChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleComplete(const v1::GenerateComplete& complete) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AppendText(const std::string& text) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The echoed prompt, with its tokens' entries; false (and failed) when the chunk lacks them.
  bool Echo(const v1::GenerateChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Streaming: the pending entries for the next event (null when the request has none pending).
  const std::vector<LogprobEntry>* PendingLogprobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the answer: end_ filled by the caller but for the finish reason.
  void Finish(const std::string& finish_reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Fail(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const ResponseMeta meta_;
  uint32_t prompt_tokens_ = 0;  // set once by Start, before the call starts
  grpc::ClientContext context_;
  v1::GenerateRequest generate_;
  v1::GenerateResponse message_;  // the read in flight; touched by gRPC callbacks only

  absl::Mutex mu_;
  model::StreamDetokenizer detokenizer_ ABSL_GUARDED_BY(mu_);
  std::function<void()> wake_ ABSL_GUARDED_BY(mu_);
  bool armed_ ABSL_GUARDED_BY(mu_) = false;             // a poll found nothing: wake on news
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;           // a chunk came
  bool done_ ABSL_GUARDED_BY(mu_) = false;              // no more output
  std::optional<ApiError> error_ ABSL_GUARDED_BY(mu_);  // how it failed
  absl::Status abandoned_ ABSL_GUARDED_BY(mu_);         // Abandon's reason
  std::string text_ ABSL_GUARDED_BY(mu_);               // not streaming: the answer so far
  std::string events_ ABSL_GUARDED_BY(mu_);             // streaming: events not yet polled
  ChoiceEnd end_ ABSL_GUARDED_BY(mu_);
  uint32_t completion_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<LogprobTrack> track_ ABSL_GUARDED_BY(mu_);  // with logprobs
  // With logprobs: every entry (not streaming), or those not yet in an event (streaming).
  std::vector<LogprobEntry> logprobs_ ABSL_GUARDED_BY(mu_);
  std::vector<LogprobEntry> sent_logprobs_ ABSL_GUARDED_BY(mu_);  // the last event's
  bool first_chunk_ ABSL_GUARDED_BY(mu_) = true;
  std::shared_ptr<Exchange> self_;  // keeps the exchange alive until OnDone
};

// The exchanges of one server until each is destroyed, not just until its HTTP request ends (a
// call may run on after its answer went out, e.g. for its status). Whoever owns the channel
// cancels them and waits for them before dropping it: the channel's last reference must never
// be dropped by a call's own callback on a thread of gRPC's callback completion queue, which
// would then shut that queue down from one of its own threads (gRPC 1.51 aborts in
// grpc_cq_internal_unref, "ref_counted.h:183 assertion failed: prior > 0").
//
// Thread-safe. Shared by the server and each exchange's deleter, so it outlives both.
class ExchangeSet {
 public:
  // Abandons (Exchange::Abandon) every exchange still alive, with `why`.
  void CancelAll(const absl::Status& why);
  // Returns once every exchange is destroyed, members and all.
  void AwaitEmpty();

 private:
  friend class Exchange;
  uint64_t Reserve();
  void Add(uint64_t id, std::weak_ptr<Exchange> exchange);
  void Remove(uint64_t id);  // from the exchange's deleter, after it was deleted

  absl::Mutex mu_;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::weak_ptr<Exchange>> alive_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_EXCHANGE_H_
