// Continuous batching on the decode node: one scheduler thread runs decode steps over every
// running request; requests join (after their prefill landed) and leave (finished, aborted,
// preempted, failed) between steps. A step is one call of the step executor over the whole
// running batch (step_executor.h: the dense work once for the batch, each request's attention
// with its own sparse policy over its own host pages), so a step is one token for every running
// request.
//
// Preemption rule (docs/SERVING.md): before a request's step needs a new page per layer and KV
// head and the arena has too few free pages, the YOUNGEST running request (latest admitted) is
// ended with RESOURCE_EXHAUSTED ("preempted") and its pages freed, repeatedly, until the page fits;
// if the youngest is the request itself, it is the one that ends. Older requests thus always
// finish; nothing stalls waiting for pages. A preempted request that had older ones beside it is
// `resumable`: its call recomputes its KV once pages free up and it joins again where it stopped
// (generate_call.h, Resume), so the client never sees the preemption.
//
// Thread-safe: Join() from any thread; a DecodeRequest's output fields are guarded by its mutex.
#ifndef FLUXION_DECODE_SERVING_BATCH_SCHEDULER_H_
#define FLUXION_DECODE_SERVING_BATCH_SCHEDULER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "decode/kv/kv_admission.h"
#include "decode/step/sparse_attention.h"
#include "decode/step/step_executor.h"
#include "model/model.h"
#include "model/sampler.h"

namespace fluxion::decode {

enum class Finish { kNone, kStop, kLength, kAbort, kError };

// One request in the running batch. The fields above `mu` are set before Join() and then owned
// by the scheduler thread; `abort` may be set by anyone; the rest is the scheduler's output.
struct DecodeRequest {
  std::string id;
  uint64_t admission_seq = 0;             // larger = younger (the preemption victim)
  std::unique_ptr<model::Sequence> seq;   // holds the SparseAttention and its pages
  SparseAttention* attention = nullptr;   // seq's attention
  std::optional<model::Sampler> sampler;
  std::vector<int32_t> stop_ids;          // EOS (unless ignore_eos) + stop_token_ids
  int64_t max_tokens = 0;                 // completion tokens, the first one included
  int64_t context_limit = 0;              // model context; 0 = none
  int32_t last_token = 0;                 // next input
  int64_t completion_tokens = 0;

  std::atomic<bool> abort{false};

  absl::Mutex mu;
  std::vector<int32_t> pending ABSL_GUARDED_BY(mu);  // produced, not yet streamed
  // Beside `pending`, one per token, when the request asks for logprobs.
  std::vector<model::TokenLogprobs> pending_logprobs ABSL_GUARDED_BY(mu);
  Finish finish ABSL_GUARDED_BY(mu) = Finish::kNone;
  absl::Status error ABSL_GUARDED_BY(mu);             // with kError
  std::optional<int32_t> matched_stop ABSL_GUARDED_BY(mu);
  uint64_t max_step_us ABSL_GUARDED_BY(mu) = 0;
  double read_fraction ABSL_GUARDED_BY(mu) = 1.0;
  sparse::SelectionStats sparse_stats ABSL_GUARDED_BY(mu);  // of its decode steps, set at the end
  sparse::GuardStats guard_stats ABSL_GUARDED_BY(mu);       // its error guard's, set at the end
  bool preempted ABSL_GUARDED_BY(mu) = false;  // ended by the preemption rule
  // Preempted while older requests still ran: the pages it needs come back when they end. A
  // request preempted alone would only meet the same shortage again.
  bool resumable ABSL_GUARDED_BY(mu) = false;
};

// Records `token` as produced by `r` (into `pending`, its `logprobs` into `pending_logprobs` when
// given) and says whether it ends `r`: kStop for a stop token, kLength at max_tokens or the
// context limit, kNone otherwise. Used for the first token (from the prefill node) and by the
// scheduler for every later one. REQUIRES: the caller owns r's scheduler-side fields.
Finish AcceptToken(DecodeRequest& r, int32_t token,
                   const std::optional<model::TokenLogprobs>& logprobs = std::nullopt);

// Ends `r`: frees its pages (destroys its sequence), then publishes `finish` (the first one set
// wins) so that whoever sees `finish != kNone` also sees the pages back in the arena.
void EndRequest(DecodeRequest& r, Finish finish, absl::Status error);

class DecodeNodeMetrics;  // decode/serving/decode_metrics.h

class BatchScheduler {
 public:
  // `model` and `admission` must outlive the scheduler. `growth_pages`: pages one more token
  // needs when it starts a page (num_layers * num_kv_heads).
  // `node_metrics` (may be null) gets every step's wall and CPU time; it must outlive the
  // scheduler.
  // `executor` computes the steps (step_executor.h; must outlive the scheduler); null: the
  // batched CPU executor over `model`, on `cpu_pool` (the process's --cpu-threads pool; must
  // outlive the scheduler; null: the executor's default).
  BatchScheduler(const model::Model* model, KvAdmission* admission, int64_t growth_pages,
                 int64_t page_tokens, DecodeNodeMetrics* node_metrics = nullptr,
                 StepExecutor* executor = nullptr,
                 const kernels::cpu::CpuPool* cpu_pool = nullptr);
  // Ends every running request with an error (Unavailable: shutting down) and stops the thread.
  ~BatchScheduler();
  BatchScheduler(const BatchScheduler&) = delete;
  BatchScheduler& operator=(const BatchScheduler&) = delete;

  // Adds `r` to the batch from the next step on.
  void Join(std::shared_ptr<DecodeRequest> r);
  // Adds all of `rs` to the batch from the same next step on.
  void JoinAll(std::vector<std::shared_ptr<DecodeRequest>> rs);

  // Fault injection for tests (`fluxion decode --test-step-delay-ms`): sleeps `delay` after every
  // step, so that a request of n tokens takes at least (n - 1) x delay on any machine, as the
  // prefill node's --test-layer-delay-ms does for a prefill. Any thread, any time.
  void SetStepDelayForTesting(absl::Duration delay) {
    step_delay_us_ = absl::ToInt64Microseconds(delay);
  }

  int64_t running() const { return running_count_.load(); }
  // Mean step time over recent steps (exponential, ~10 s horizon at busy rates), 0 when idle.
  double recent_step_ms() const;
  uint64_t preempted() const { return preempted_.load(); }

 private:
  void Loop();
  void End(DecodeRequest& r, Finish finish, absl::Status error);  // EndRequest
  // Before a step: ends aborted requests and applies the preemption rule to requests whose next
  // token starts a page. Returns the requests that take part in the step.
  std::vector<DecodeRequest*> PrepareStep();
  // One step of the executor over `batch` (which samples each request's token with its sampler),
  // then the finish rules per request.
  void RunStep(const std::vector<DecodeRequest*>& batch);

  const model::Model* const model_;
  KvAdmission* const admission_;
  const int64_t growth_pages_;
  const int64_t page_tokens_;
  DecodeNodeMetrics* const node_metrics_;
  std::unique_ptr<StepExecutor> owned_executor_;  // when none was given
  StepExecutor* const executor_;
  std::vector<StepRequest> step_batch_;           // scheduler thread only
  std::vector<int32_t> tokens_;                   // each request's next token, scheduler thread
  std::vector<float> logits_;                     // [batch][vocab], scheduler thread only
  std::vector<absl::Status> statuses_;

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<DecodeRequest>> joining_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  double step_ms_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_step_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();

  std::vector<std::shared_ptr<DecodeRequest>> running_;  // scheduler thread only
  std::atomic<int64_t> running_count_{0};
  std::atomic<uint64_t> preempted_{0};
  std::atomic<int64_t> step_delay_us_{0};
  std::thread thread_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_BATCH_SCHEDULER_H_
