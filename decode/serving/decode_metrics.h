// The decode node's Prometheus metrics (docs/METRICS.md, names in common/metrics_names.h).
//
// Two kinds, so nothing is counted twice:
//   - read at scrape time (Attach): load gauges (running / waiting / prefilling requests, KV pages,
//     usage) and counters the service already keeps in its plain DecodeMetrics struct (finish
//     reasons, prompt and completion tokens, preemptions), read through callbacks;
//   - events (the On* hooks): histograms and labelled counters that need a value at the moment the
//     service already takes a timing (queue time, TTFT, TPOT, E2E, step time, transfer, sparse
//     statistics of a finished request, final status codes).
//
// The service and the scheduler take a `DecodeNodeMetrics*` (null: no metrics, as in unit tests).
// Thread-safe (the registry's metrics are atomics; hooks are called from many threads).
#ifndef FLUXION_DECODE_SERVING_DECODE_METRICS_H_
#define FLUXION_DECODE_SERVING_DECODE_METRICS_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "decode/sparse/policy.h"

namespace fluxion::decode {

class BatchScheduler;
class DecodeServiceImpl;
class KvAdmission;
class KvArena;

struct DecodeMetricsConfig {
  int64_t page_tokens = 16;
  int64_t num_layers = 1;
  int64_t num_kv_heads = 1;
  std::string default_policy;
  double default_budget = 0.1;
  std::string model_name;  // fluxion_model_info's model_name label
};

// What the service knows about a request when it ends (after it joined the batch).
struct FinishedRequestStats {
  double ttft_seconds = -1;  // < 0: no token was sent
  double e2e_seconds = 0;
  double prefill_seconds = -1;  // admitted to prefill landed; < 0: it never landed
  double decode_seconds = -1;   // first token sent to the end; < 0: no token was sent
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  std::string policy;        // the policy's name (PolicyConfig::name)
  double read_fraction = 1;  // rows attended / rows available over its decode steps
  sparse::SelectionStats sparse;
  sparse::GuardStats guard;  // the online error guard's (empty when off)
};

class DecodeNodeMetrics {
 public:
  // Creates the event metrics in `registry` (which must outlive this object) and sets the static
  // ones (page size, cache config info, default budget).
  DecodeNodeMetrics(metrics::Registry* registry, const DecodeMetricsConfig& config);
  // Removes the scrape-time callbacks (Detach).
  ~DecodeNodeMetrics();
  DecodeNodeMetrics(const DecodeNodeMetrics&) = delete;
  DecodeNodeMetrics& operator=(const DecodeNodeMetrics&) = delete;

  // Registers the scrape-time gauges and counters, reading these objects, which must stay alive
  // until Detach() (or destruction) and while the registry may still be rendered.
  void Attach(const DecodeServiceImpl* service, const BatchScheduler* scheduler,
              const KvAdmission* admission, const KvArena* arena);
  void Detach();

  // Event hooks.
  void OnRequestDone(int grpc_code);                  // a Generate call's final status
  void OnAdmitted(double queue_seconds);              // pages reserved
  void OnPrefillLanded(uint64_t bytes, double transfer_seconds);
  // A failed Prefill call / landed KV that did not verify. Cancelled and expired calls are not
  // failures. `sent` false: no connection could be made, the request never left (cause
  // "connect").
  void OnTransferFailed(absl::StatusCode code, bool sent = true);
  // A Prefill call the decode node aborted because the request's deadline passed.
  void OnPrefillExpired();
  // A request's pages quarantined because a peer may still write them; `reason` is a
  // WriteHoldName.
  void OnQuarantined(const char* reason);
  void OnChecksumFailure();
  void OnFinished(const FinishedRequestStats& r);
  // `tokens` of one request left the node together, `seconds` after its previous ones: each
  // observes seconds / tokens as its inter-token latency.
  void OnTokensSent(double seconds, int64_t tokens);
  void OnStep(double wall_seconds, double cpu_seconds);

 private:
  metrics::Registry* const registry_;
  const DecodeMetricsConfig config_;
  metrics::Histogram* queue_;
  metrics::Histogram* ttft_;
  metrics::Histogram* tpot_;
  metrics::Histogram* e2e_;
  metrics::Histogram* itl_;
  metrics::Histogram* prefill_time_;
  metrics::Histogram* decode_time_;
  metrics::Histogram* prompt_tokens_;
  metrics::Histogram* generation_tokens_;
  metrics::Histogram* step_;
  metrics::Counter* step_cpu_;
  metrics::Counter* bytes_received_;
  metrics::Histogram* transfer_seconds_;
  metrics::Counter* head_steps_selected_;
  metrics::Counter* head_steps_bypassed_;
  metrics::Counter* rows_attended_;
  metrics::Counter* rows_scored_;
  metrics::Counter* rows_context_;
  metrics::Counter* prefill_expired_;
  metrics::Histogram* guard_error_;
  metrics::Counter* guard_checks_;
  metrics::Counter* guard_escalations_;
  metrics::Counter* guard_relaxations_;
  metrics::Counter* guard_reverts_;
  metrics::Counter* rows_guard_;

  absl::Mutex mu_;
  // Series registered by Attach, removed by Detach.
  std::vector<std::pair<std::string, metrics::Labels>> attached_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_DECODE_METRICS_H_
