// The prefill node's Prometheus metrics (docs/METRICS.md, names in common/metrics_names.h).
//
// As on the decode node (decode/serving/decode_metrics.h), nothing is counted twice: queue gauges
// and the counters the service and its transport already keep (PrefillServiceImpl::metrics():
// prompt tokens; TransportMetrics: bytes written, failures by cause) are read at scrape time
// through callbacks (Attach); the histograms and the per-status request counter are fed by hooks at
// the points where the service already takes its timings.
//
// Thread-safe.
#ifndef FLUXION_PREFILL_PREFILL_METRICS_H_
#define FLUXION_PREFILL_PREFILL_METRICS_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "fluxion/v1/prefill.pb.h"

namespace fluxion::prefill {

class PrefillServiceImpl;

class PrefillNodeMetrics {
 public:
  // Creates the event metrics in `registry`, which must outlive this object.
  explicit PrefillNodeMetrics(metrics::Registry* registry);
  ~PrefillNodeMetrics();  // Detach()
  PrefillNodeMetrics(const PrefillNodeMetrics&) = delete;
  PrefillNodeMetrics& operator=(const PrefillNodeMetrics&) = delete;

  // Registers the scrape-time gauges and counters reading `service` (and its transport), which
  // must stay alive until Detach() and while the registry may be rendered.
  void Attach(const PrefillServiceImpl* service);
  void Detach();

  void OnRequestDone(int grpc_code);                       // a Prefill call's final status
  void OnComputed(const fluxion::v1::PrefillTiming& timing);  // a successful Prefill call

 private:
  metrics::Registry* const registry_;
  metrics::Histogram* compute_;
  metrics::Histogram* transfer_tail_;
  metrics::Histogram* transfer_;
  absl::Mutex mu_;
  std::vector<std::pair<std::string, metrics::Labels>> attached_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_PREFILL_METRICS_H_
