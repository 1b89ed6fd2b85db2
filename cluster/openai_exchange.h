// One OpenAI HTTP request in flight: the Generate call to the router's own DecodeService (over
// the gRPC server's in-process channel, so routing, retries, shedding, deadlines and
// cancellation are the router's one implementation), the streaming detokenizer with the
// request's stop strings, and the bytes the HTTP side has yet to send.
//
// The HTTP side never blocks: it asks for the reply head (status and, unless streaming, the whole
// body) or for stream bytes, and when there is nothing yet it hands a `suspend` function that is
// run under the exchange's lock; the exchange runs `wake` (the HTTP side's resume) as soon as
// there is news. So a wake can never be lost between the check and the suspend.
//
// Thread-safe. Owned by shared_ptr: by the HTTP connection, and by itself while its call runs;
// an ExchangeSet knows each one until it is destroyed.
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
  // Starts the call. `stub` and `tokenizer` must outlive the exchange; `wake` is called (from a
  // gRPC thread, under the exchange's lock, so it must not call back in) after a `suspend`.
  // `metadata` goes with the Generate call (HTTP headers the router reads, e.g. the gateway's
  // prefill pick: cluster/prefill_pick.h); keys lowercase. `set` holds the exchange until it is
  // destroyed.
  static std::shared_ptr<Exchange> Start(
      v1::DecodeService::Stub* stub, const model::Tokenizer* tokenizer,
      v1::GenerateRequest generate, const Request& request, ResponseMeta meta,
      model::StreamDetokenizer detokenizer, std::function<void()> wake,
      const std::shared_ptr<ExchangeSet>& set,
      const std::vector<std::pair<std::string, std::string>>& metadata = {});

  // The reply's status line and headers are decided: a failure before any output, the whole
  // body once the call ended (not streaming), or 200 once the first chunk came (streaming).
  struct Head {
    int http_status = 200;
    bool streaming = false;
    std::string body;  // not streaming: the whole body
    int retry_after_s = 0;
  };
  // The head when decided; otherwise runs `suspend` and returns nullopt (wake follows).
  std::optional<Head> HeadOrSuspend(const std::function<void()>& suspend);

  // Streaming: copies up to `max` pending bytes into `buf` and returns how many; -1 at the end of
  // the stream; 0 after running `suspend` when nothing is pending yet (wake follows).
  long ReadOrSuspend(char* buf, size_t max, const std::function<void()>& suspend);

  // The client went away (or the server stops): cancels the call, which the router relays to the
  // decode node; no wake after this.
  void Cancel();
  // The client hung up, or the server stops: cancels the call but still wakes the connection,
  // which then answers (or ends its stream) with `why` and completes, so the server can stop.
  void Abandon(const absl::Status& why);

  // grpc::ClientReadReactor
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  Exchange(const model::Tokenizer* tokenizer, const Request& request, ResponseMeta meta,
           model::StreamDetokenizer detokenizer, std::function<void()> wake);
  // Handles one message; false when no more should be read (a stop string matched).
  bool Handle(const v1::GenerateResponse& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AppendText(const std::string& text) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the answer: end_ filled by the caller but for the finish reason.
  void Finish(const std::string& finish_reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Fail(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool HeadReadyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const model::Tokenizer* const tokenizer_;
  const bool stream_;
  const bool include_usage_;
  const bool include_stop_str_;                // include_stop_str_in_output
  const std::vector<uint32_t> stop_token_ids_;  // the request's, for stop_reason
  const ResponseMeta meta_;
  uint32_t prompt_tokens_ = 0;  // set once by Start, before the call starts
  grpc::ClientContext context_;
  v1::GenerateRequest generate_;
  v1::GenerateResponse message_;  // the read in flight; touched by gRPC callbacks only

  absl::Mutex mu_;
  model::StreamDetokenizer detokenizer_ ABSL_GUARDED_BY(mu_);
  std::function<void()> wake_ ABSL_GUARDED_BY(mu_);
  bool suspended_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;           // a chunk came: streaming answers 200
  bool done_ ABSL_GUARDED_BY(mu_) = false;              // no more output
  std::optional<ApiError> error_ ABSL_GUARDED_BY(mu_);  // failure before any output
  absl::Status abandoned_ ABSL_GUARDED_BY(mu_);         // Abandon's reason
  std::string text_ ABSL_GUARDED_BY(mu_);               // not streaming: the answer so far
  std::string pending_ ABSL_GUARDED_BY(mu_);            // streaming: SSE bytes not yet handed out
  ChoiceEnd end_ ABSL_GUARDED_BY(mu_);
  uint32_t completion_tokens_ ABSL_GUARDED_BY(mu_) = 0;
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
