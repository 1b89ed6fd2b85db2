#include "decode/serving/decode_metrics.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/metrics_names.h"
#include "decode/kv/kv_admission.h"
#include "decode/kv/kv_arena.h"
#include "decode/serving/batch_scheduler.h"
#include "decode/serving/decode_service.h"

namespace fluxion::decode {
namespace names = metrics::names;

namespace {

// Read fraction per request: a budget of 0.02 to 0.1 is the interesting range, 1 is `full`.
std::vector<double> FractionBuckets() {
  return {0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0};
}

// e_h of checked heads: the guard's tolerance is a few percent; a bypassed needle head is ~1.
std::vector<double> GuardErrorBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0};
}

// Decode steps of the tiny model take well under a millisecond; big ones tens of ms.
std::vector<double> StepBuckets() { return metrics::ExponentialBuckets(0.0001, 2.5, 12); }
// Token counts 1, 2, 5, 10, ... 5M (vLLM's 1-2-5 series, past any context).
std::vector<double> TokenBuckets() {
  std::vector<double> b;
  for (double decade = 1; decade <= 1e6; decade *= 10) {
    for (double m : {1.0, 2.0, 5.0}) b.push_back(m * decade);
  }
  return b;
}

// Transfer failure cause label (docs/METRICS.md) of a failed Prefill call.
const char* TransferCause(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable: return "peer_unreachable";
    case absl::StatusCode::kDeadlineExceeded: return "deadline";
    case absl::StatusCode::kDataLoss: return "checksum";
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAlreadyExists: return "rejected";
    default: return "other";
  }
}

}  // namespace

DecodeNodeMetrics::DecodeNodeMetrics(metrics::Registry* registry, const DecodeMetricsConfig& config)
    : registry_(registry), config_(config) {
  metrics::Registry& r = *registry;
  queue_ = r.AddHistogram(names::kDecodeQueueSeconds, "Arrival to KV pages reserved (admission).",
                          metrics::LatencyBuckets());
  ttft_ = r.AddHistogram(names::kDecodeTtftSeconds, "Arrival to first token sent.",
                         metrics::LatencyBuckets());
  tpot_ = r.AddHistogram(names::kDecodeTpotSeconds,
                         "Per request with 2+ tokens: (E2E - TTFT) / (completion tokens - 1).",
                         metrics::LatencyBuckets());
  e2e_ = r.AddHistogram(names::kDecodeE2eSeconds, "Arrival to the request's end.",
                        metrics::LatencyBuckets());
  itl_ = r.AddHistogram(names::kDecodeInterTokenLatencySeconds,
                        "Time between a request's consecutive tokens leaving the node (tokens "
                        "sent together share the gap).",
                        StepBuckets());
  prefill_time_ = r.AddHistogram(names::kDecodeRequestPrefillSeconds,
                                 "Per request: KV pages reserved to its prefill landed (the "
                                 "prefill node's compute and the KV transfer).",
                                 metrics::LatencyBuckets());
  decode_time_ = r.AddHistogram(names::kDecodeRequestDecodeSeconds,
                                "Per request: first token sent to its end.",
                                metrics::LatencyBuckets());
  prompt_tokens_ = r.AddHistogram(names::kDecodeRequestPromptTokens,
                                  "Per finished request: its prompt tokens.", TokenBuckets());
  generation_tokens_ = r.AddHistogram(names::kDecodeRequestGenerationTokens,
                                      "Per finished request: its completion tokens.",
                                      TokenBuckets());
  r.AddGauge(names::kModelInfo, "The served model (vLLM's model_name label), value 1.",
             {{"model_name", config.model_name}})
      ->Set(1);
  step_ = r.AddHistogram(names::kDecodeStepSeconds,
                         "Wall time of one batched decode step (one token for every running "
                         "request).",
                         StepBuckets());
  prefill_expired_ = r.AddCounter(
      names::kDecodePrefillExpiredTotal,
      "Prefill calls aborted by the decode node because the request's deadline passed (not "
      "transfer failures).");
  step_cpu_ = r.AddCounter(names::kDecodeStepCpuSecondsTotal,
                           "Process CPU time (all threads) spent during decode steps.");
  r.AddCounter(names::kDecodeStepGpuSecondsTotal,
               "GPU busy time in decode steps; decode steps run on the CPU here, so always 0.");
  bytes_received_ = r.AddCounter(names::kTransferBytesTotal,
                                 "KV and sparse-state bytes moved by KV transfers.",
                                 {{"direction", "received"}});
  transfer_seconds_ = r.AddHistogram(
      names::kTransferSeconds, "One request's KV transfer, first put to last put flushed.",
      metrics::LatencyBuckets());
  head_steps_selected_ = r.AddCounter(
      names::kSparseHeadStepsTotal,
      "(decode step, layer, KV head) selections by history policies (lfps*, fluxion*), by kind: "
      "selected read middle rows, bypassed read only sinks + local window.",
      {{"kind", "selected"}});
  head_steps_bypassed_ = r.AddCounter(names::kSparseHeadStepsTotal, "", {{"kind", "bypassed"}});
  rows_attended_ = r.AddCounter(names::kSparseRowsTotal,
                                "KV rows over finished requests' decode steps, by kind: attended "
                                "(read by the attention kernel), scored (extra K rows read only to "
                                "score), context (rows available).",
                                {{"kind", "attended"}});
  rows_scored_ = r.AddCounter(names::kSparseRowsTotal, "", {{"kind", "scored"}});
  rows_context_ = r.AddCounter(names::kSparseRowsTotal, "", {{"kind", "context"}});
  rows_guard_ = r.AddCounter(names::kSparseRowsTotal, "", {{"kind", "guard_check"}});
  guard_error_ = r.AddHistogram(
      names::kSparseGuardError,
      "The online error guard's exact checks: e_h = ||W_O^h (o_h - sparse o_h)|| / ||W_O o|| of "
      "each checked (decode step, layer, KV head), per finished request's checks.",
      GuardErrorBuckets());
  guard_checks_ = r.AddCounter(names::kSparseGuardChecksTotal,
                               "(decode step, layer, KV head) pairs the error guard attended "
                               "exactly to measure their sparse error.");
  guard_escalations_ = r.AddCounter(
      names::kSparseGuardAdjustmentsTotal,
      "Budget moves of the error guard, by direction: escalation (a head above the tolerance got "
      "more of the request's budget), relaxation (a head far below gave some back), revert (an "
      "escalation undone: the head's error did not fall).",
      {{"direction", "escalation"}});
  guard_relaxations_ =
      r.AddCounter(names::kSparseGuardAdjustmentsTotal, "", {{"direction", "relaxation"}});
  guard_reverts_ =
      r.AddCounter(names::kSparseGuardAdjustmentsTotal, "", {{"direction", "revert"}});
  for (const char* cause : {"peer_unreachable", "deadline", "checksum", "rejected", "other"}) {
    r.AddCounter(names::kTransferFailuresTotal,
                 "Failed KV transfers, by cause (on the decode node: failed Prefill calls and KV "
                 "that landed with a wrong checksum).",
                 {{"cause", cause}});
  }
  r.AddGauge(names::kSparseBudgetRatio,
             "Configured budget (fraction of context tokens attended) of the default policy.",
             {{"policy", config_.default_policy}})
      ->Set(config_.default_budget);
}

DecodeNodeMetrics::~DecodeNodeMetrics() { Detach(); }

void DecodeNodeMetrics::Attach(const DecodeServiceImpl* service, const BatchScheduler* scheduler,
                               const KvAdmission* admission, const KvArena* arena) {
  absl::MutexLock lock(&mu_);
  auto gauge = [&](const char* name, const char* help, metrics::Labels labels,
                   std::function<double()> read) {
    registry_->AddGaugeCallback(name, help, labels, std::move(read));
    attached_.emplace_back(name, std::move(labels));
  };
  auto counter = [&](const char* name, const char* help, metrics::Labels labels,
                     std::function<double()> read) {
    registry_->AddCounterCallback(name, help, labels, std::move(read));
    attached_.emplace_back(name, std::move(labels));
  };
  gauge(names::kDecodeRequestsRunning, "Requests in the running decode batch.", {},
        [scheduler] { return static_cast<double>(scheduler->running()); });
  // A request being prefilled waits as much as one queued for pages: it is not decoding yet, and
  // vLLM's num_requests_waiting (which llm-d's endpoint picker reads through
  // k8s/llm-d/epp-config.yaml) counts requests waiting for remote KV. The two parts are exported
  // on their own as well.
  gauge(names::kDecodeRequestsWaiting,
        "Requests not decoding yet: queued for KV pages plus prefilling (pages reserved, KV "
        "arriving).",
        {}, [admission, service] {
          return static_cast<double>(admission->waiting() + service->prefilling_requests());
        });
  gauge(names::kDecodeRequestsAwaitingPages, "Requests queued for KV pages (nothing reserved yet).",
        {}, [admission] { return static_cast<double>(admission->waiting()); });
  gauge(names::kDecodeRequestsPrefilling,
        "Requests with pages reserved whose prefill / KV transfer is in flight.", {},
        [service] { return static_cast<double>(service->prefilling_requests()); });
  gauge(names::kKvPagesCapacity, "Pages in the host KV arena (one layer, one KV head, page_tokens).",
        {}, [arena] { return static_cast<double>(arena->counters().total); });
  gauge(names::kKvPagesFree, "Free pages in the host KV arena.", {},
        [arena] { return static_cast<double>(arena->counters().free); });
  gauge(names::kKvPagesQuarantined,
        "Pages a prefill node may still write into (neither free nor in use).", {},
        [arena] { return static_cast<double>(arena->counters().quarantined); });
  gauge(names::kKvCacheUsageRatio, "1 - free / total pages of the host KV arena.", {}, [arena] {
    const KvArenaCounters c = arena->counters();
    return c.total > 0 ? 1.0 - static_cast<double>(c.free) / c.total : 0.0;
  });
  const int64_t total_pages = arena->counters().total;
  const double page_tokens = static_cast<double>(config_.page_tokens);
  gauge(names::kKvPageTokens, "Tokens per KV page.", {}, [page_tokens] { return page_tokens; });
  const int64_t per_block = std::max<int64_t>(1, config_.num_layers * config_.num_kv_heads);
  gauge(names::kKvCacheConfigInfo,
        "KV cache facts in vLLM's cache_config_info labels: block_size = page_tokens, "
        "num_gpu_blocks = num_pages / (layers x KV heads) (host memory, not GPU).",
        {{"block_size", absl::StrCat(config_.page_tokens)},
         {"num_gpu_blocks", absl::StrCat(total_pages / per_block)},
         {"page_tokens", absl::StrCat(config_.page_tokens)},
         {"num_pages", absl::StrCat(total_pages)}},
        [] { return 1.0; });

  const char* finished_help = "Requests that joined the batch (or were aborted before), by finish reason.";
  auto finished = [&](const char* reason, uint64_t DecodeMetrics::*field) {
    counter(names::kDecodeFinishedTotal, finished_help, {{"reason", reason}},
            [service, field] { return static_cast<double>(service->metrics().*field); });
  };
  finished("stop", &DecodeMetrics::finished_stop);
  finished("length", &DecodeMetrics::finished_length);
  finished("abort", &DecodeMetrics::finished_abort);
  finished("error", &DecodeMetrics::finished_error);
  finished("preempted", &DecodeMetrics::finished_preempted);
  counter(names::kDecodePromptTokensTotal, "Prompt tokens of admitted requests.", {},
          [service] { return static_cast<double>(service->metrics().prompt_tokens); });
  counter(names::kDecodeGenerationTokensTotal,
          "Completion tokens sent, counted when each request ends.", {},
          [service] { return static_cast<double>(service->metrics().completion_tokens); });
  counter(names::kDecodePreemptionsTotal,
          "Requests ended to free KV pages for older ones (the youngest-first rule).", {},
          [scheduler] { return static_cast<double>(scheduler->preempted()); });
  counter(names::kDecodePreemptionsResumedTotal,
          "Preempted requests whose KV was recomputed once pages came back and that went on "
          "decoding; their clients saw no error.",
          {}, [service] { return static_cast<double>(service->metrics().resumed); });
  counter(names::kTransferLandingRefusedTotal,
          "Peers' KV write messages this node refused before touching memory: a key revoked or "
          "never issued here, a range outside its registration, a malformed message (a stale, "
          "buggy or hostile writer).",
          {}, [service] {
            return static_cast<double>(service->metrics().transport.landing_refused);
          });
}

void DecodeNodeMetrics::Detach() {
  absl::MutexLock lock(&mu_);
  for (const auto& [name, labels] : attached_) registry_->Remove(name, labels);
  attached_.clear();
}

void DecodeNodeMetrics::OnRequestDone(int grpc_code) {
  registry_
      ->AddCounter(names::kDecodeRequestsTotal, "Generate calls by final gRPC status.",
                   {{"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(grpc_code))}})
      ->Increment();
}

void DecodeNodeMetrics::OnAdmitted(double queue_seconds) { queue_->Observe(queue_seconds); }

void DecodeNodeMetrics::OnPrefillLanded(uint64_t bytes, double transfer_seconds) {
  bytes_received_->Increment(static_cast<double>(bytes));
  transfer_seconds_->Observe(transfer_seconds);
}

void DecodeNodeMetrics::OnTransferFailed(absl::StatusCode code, bool sent) {
  registry_
      ->AddCounter(names::kTransferFailuresTotal, "",
                   {{"cause", sent ? TransferCause(code) : "connect"}})
      ->Increment();
}

void DecodeNodeMetrics::OnPrefillExpired() { prefill_expired_->Increment(); }

void DecodeNodeMetrics::OnQuarantined(const char* reason) {
  registry_
      ->AddCounter(names::kKvQuarantinedReservationsTotal,
                   "Requests whose reserved pages were held for the quarantine lease because a "
                   "peer may still write them, by why.",
                   {{"reason", reason}})
      ->Increment();
}

void DecodeNodeMetrics::OnChecksumFailure() { OnTransferFailed(absl::StatusCode::kDataLoss); }

void DecodeNodeMetrics::OnTokensSent(double seconds, int64_t tokens) {
  for (int64_t i = 0; i < tokens; ++i) itl_->Observe(seconds / static_cast<double>(tokens));
}

void DecodeNodeMetrics::OnFinished(const FinishedRequestStats& r) {
  e2e_->Observe(r.e2e_seconds);
  if (r.prefill_seconds >= 0) prefill_time_->Observe(r.prefill_seconds);
  if (r.decode_seconds >= 0) decode_time_->Observe(r.decode_seconds);
  prompt_tokens_->Observe(static_cast<double>(r.prompt_tokens));
  generation_tokens_->Observe(static_cast<double>(r.completion_tokens));
  if (r.ttft_seconds >= 0) {
    ttft_->Observe(r.ttft_seconds);
    if (r.completion_tokens > 1) {
      tpot_->Observe((r.e2e_seconds - r.ttft_seconds) / static_cast<double>(r.completion_tokens - 1));
    }
  }
  if (r.sparse.context > 0) {
    registry_
        ->AddHistogram(names::kSparseReadFraction,
                       "Per finished request: rows attended / rows available over its decode "
                       "steps, by policy.",
                       FractionBuckets(), {{"policy", r.policy}})
        ->Observe(r.read_fraction);
  }
  head_steps_selected_->Increment(static_cast<double>(r.sparse.selections - r.sparse.bypassed));
  head_steps_bypassed_->Increment(static_cast<double>(r.sparse.bypassed));
  rows_attended_->Increment(static_cast<double>(r.sparse.rows_attended));
  rows_scored_->Increment(static_cast<double>(r.sparse.k_rows_scored));
  rows_context_->Increment(static_cast<double>(r.sparse.context));
  for (double e : r.guard.errors) guard_error_->Observe(e);
  guard_checks_->Increment(static_cast<double>(r.guard.checks));
  guard_escalations_->Increment(static_cast<double>(r.guard.escalations));
  guard_relaxations_->Increment(static_cast<double>(r.guard.relaxations));
  guard_reverts_->Increment(static_cast<double>(r.guard.reverts));
  rows_guard_->Increment(static_cast<double>(r.guard.check_rows));
}

void DecodeNodeMetrics::OnStep(double wall_seconds, double cpu_seconds) {
  step_->Observe(wall_seconds);
  step_cpu_->Increment(cpu_seconds);
}

}  // namespace fluxion::decode
