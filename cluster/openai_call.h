// One POST of the HTTP API from its complete body to its Generate call. The CPU work (parsing,
// chat template, tokenization: Prepare) runs on a worker, never on the polling thread; CallState
// is what the connection (libmicrohttpd's polling thread), that worker and the hang-up watcher
// share meanwhile, and afterwards while the call runs.
//
// Ownership: each holds the CallState by shared_ptr; the state holds the exchange it started.
// The connection waits suspended until the worker's outcome (OutcomeOrSuspend and Finish take one
// lock, so a resume is never lost between the check and the suspend, as in Completion).
//
// Thread-safe.
#ifndef FLUXION_CLUSTER_OPENAI_CALL_H_
#define FLUXION_CLUSTER_OPENAI_CALL_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cluster/openai_completion.h"
#include "cluster/openai_generate.h"
#include "cluster/openai_request.h"
#include "cluster/openai_response.h"
#include "fluxion/v1/decode.pb.h"
#include "model/generation_config.h"
#include "model/stream_detokenizer.h"
#include "model/tokenizer.h"

namespace fluxion::cluster::openai {

// What every preparation borrows from the server (which outlives them).
struct Preparer {
  const model::Tokenizer* tokenizer = nullptr;
  const ChatRenderer* chat = nullptr;
  std::string model_name;
  ParseLimits parse_limits;
  // Rendering plus tokenizing one prompt may take this long, then the request is refused (400).
  absl::Duration tokenize_timeout = absl::Seconds(10);
  // The model's context (config.json's max_position_embeddings); 0: unknown, the decode node
  // checks alone (openai_generate.h, CheckContextLength).
  int64_t max_context_tokens = 0;
  // The model's generation_config.json: temperature, top_p and top_k for requests without them.
  model::GenerationDefaults generation_defaults;
};

// NotFound naming `model` (param "model") unless it is the served model.
absl::Status CheckModel(const Preparer& preparer, const std::string& model);

// `cancelled`, and InvalidArgument saying so once the preparer's tokenize_timeout has passed
// since this call: the bound on one request's rendering and tokenization.
model::EncodeCheck BoundedCheck(const Preparer& preparer, model::EncodeCheck cancelled);

// Parses `body`, checks the model, renders and tokenizes the prompt. `id` is the response id,
// `cancelled` is polled while tokenizing (its error ends the preparation). Errors are the answer
// (ErrorFromStatus): 400 naming the field, 404 for another model, 400 saying so for a prompt that
// took longer than the timeout to tokenize.
absl::StatusOr<Prepared> Prepare(const Preparer& preparer, Endpoint endpoint,
                                 absl::string_view body, const std::string& id,
                                 const model::EncodeCheck& cancelled);

// What a preparation led to: running calls, or (tokenize, detokenize) a whole JSON body.
struct Answer {
  std::shared_ptr<Completion> completion;  // null: `body` is the answer
  std::string body;
};

class CallState {
 public:
  using Outcome = absl::StatusOr<Answer>;

  // `resume` resumes the waiting connection (MHD_resume_connection and the server's count).
  explicit CallState(std::function<void()> resume) : resume_(std::move(resume)) {}

  // Any thread: the client hung up, or the server stops. A preparation stops at its next check
  // with `why` as its answer; a running call is cancelled (Completion::Abandon: the connection
  // still wakes, answers and completes). Only the first reason counts.
  void Cancel(const absl::Status& why);
  // OK, or the reason Cancel was given (the preparation's check).
  absl::Status CancelledWhy() const;

  // Worker: records the outcome, resuming the connection if it waits. When `prepared` is OK and
  // the state is not cancelled, `start` starts the call first, under the state's lock, so that a
  // concurrent Cancel either finds the exchange or keeps it from starting.
  void Finish(const absl::Status& prepared,
              const std::function<std::shared_ptr<Completion>()>& start);

  // Worker: a whole answer computed without a call (or its error), resuming the connection if it
  // waits.
  void FinishWithBody(absl::StatusOr<std::string> body);

  // Polling thread: the outcome once Finish ran; otherwise runs `suspend` (under the lock) and
  // returns nullopt (Finish resumes the connection).
  std::optional<Outcome> OutcomeOrSuspend(const std::function<void()>& suspend);

  // Polling thread, when the HTTP request completed: no resume after this, and a call still
  // running is cancelled without a wake (Completion::Cancel).
  void Detach();

 private:
  void ResumeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::function<void()> resume_;
  mutable absl::Mutex mu_;
  absl::Status why_ ABSL_GUARDED_BY(mu_);  // non-OK once cancelled
  bool suspended_ ABSL_GUARDED_BY(mu_) = false;
  bool detached_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<Outcome> outcome_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Completion> completion_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_CALL_H_
