// One OpenAI HTTP request's answer over its choices (prompts x n; openai_exchange.h runs one
// Generate call per choice): the status line once decided, then the whole body (every choice in
// index order) or the server-sent events of every choice interleaved as they come, then the
// usage and [DONE] (docs/PROTOCOL.md, "Answers").
//
// The HTTP side never blocks: it asks for the head or for stream bytes, and when there is
// nothing yet it hands a `suspend` function, run under the completion's lock; any choice's news
// runs `wake` (the HTTP side's resume) once. A poll that races with news sees a changed news
// count and polls again, so a wake is never lost between the check and the suspend.
//
// A choice that fails before the status line decides it (the error is the answer) and cancels
// the others; after a streamed 200, its error event ends the stream and the others are
// cancelled.
//
// Thread-safe: Head/Read from the HTTP polling thread; wakes from gRPC threads.
#ifndef FLUXION_CLUSTER_OPENAI_COMPLETION_H_
#define FLUXION_CLUSTER_OPENAI_COMPLETION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "cluster/openai_exchange.h"
#include "cluster/openai_generate.h"
#include "cluster/openai_request.h"
#include "cluster/openai_response.h"
#include "model/stream_detokenizer.h"

namespace fluxion::cluster::openai {

// A request ready for its Generate calls: one per choice, each with its own detokenizer.
struct Prepared {
  Request request;
  std::vector<PreparedChoice> choices;
  std::vector<model::StreamDetokenizer> detokenizers;  // one per choice
  ResponseMeta meta;
  const model::Tokenizer* tokenizer = nullptr;  // the texts of logprobs' tokens
  // With echo: each prompt's text as the answer shows it (given text as is, ids decoded).
  std::vector<std::string> echo_texts;
};

class Completion {
 public:
  // Starts every choice's call. `stub` must outlive the completion; `wake` is called from a gRPC
  // thread, at most once per suspend, and must not call back in. `metadata` goes with every call
  // (Exchange::Start).
  static std::shared_ptr<Completion> Start(
      v1::DecodeService::Stub* stub, Prepared prepared, std::function<void()> wake,
      const std::shared_ptr<ExchangeSet>& set,
      const std::vector<std::pair<std::string, std::string>>& metadata = {});
  // Cancels the calls still running (no wake after it returns).
  ~Completion();
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;

  // The reply's status line and headers are decided: a failure before any output, the whole
  // body once every choice ended (not streaming), or 200 once a choice's first chunk came
  // (streaming).
  struct Head {
    int http_status = 200;
    bool streaming = false;
    std::string body;  // not streaming: the whole body
    int retry_after_s = 0;
  };
  // The head when decided; otherwise runs `suspend` and returns nullopt (wake follows).
  std::optional<Head> HeadOrSuspend(const std::function<void()>& suspend);

  // Streaming: copies up to `max` pending bytes into `buf` and returns how many; -1 at the end
  // of the stream; 0 after running `suspend` when nothing is pending yet (wake follows).
  long ReadOrSuspend(char* buf, size_t max, const std::function<void()>& suspend);

  // The client went away: cancels every call; no wake after this.
  void Cancel();
  // The client hung up, or the server stops: cancels every call but still wakes, so that the
  // connection answers (or ends its stream) with `why`.
  void Abandon(const absl::Status& why);

 private:
  explicit Completion(const Prepared& prepared, std::function<void()> wake);

  // Where the choices stand after one poll of each (streamed events appended to out_).
  struct Poll {
    bool any_started = false;
    bool all_done = true;
    std::optional<ApiError> error;  // the first failed choice's, by index
  };
  Poll PollChoices();
  // Under the lock: runs `suspend` unless news came since `seen` (then the caller polls again).
  bool SuspendUnlessNews(uint64_t seen, const std::function<void()>& suspend);
  uint64_t News();
  void OnNews();
  // The others of a failed choice: cancelled, their output dropped.
  void CancelChoices();
  TokenUsage Usage();
  Head WholeBody();

  const bool stream_;
  const bool include_usage_;
  const ResponseMeta meta_;
  std::vector<std::shared_ptr<Exchange>> choices_;
  std::vector<size_t> prompt_of_;  // each choice's prompt

  // The HTTP polling thread's.
  std::string out_;        // streaming: bytes not yet handed out
  bool failed_ = false;    // a choice failed after the 200: the stream ends
  bool tail_ = false;      // usage and [DONE] are in out_

  absl::Mutex mu_;
  std::function<void()> wake_ ABSL_GUARDED_BY(mu_);
  uint64_t news_ ABSL_GUARDED_BY(mu_) = 0;
  bool suspended_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_COMPLETION_H_
