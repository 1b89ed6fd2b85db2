#include "prefill/prefill_metrics.h"

#include <functional>

#include "absl/status/status.h"
#include "common/metrics_names.h"
#include "prefill/prefill_service.h"

namespace fluxion::prefill {
namespace names = metrics::names;

PrefillNodeMetrics::PrefillNodeMetrics(metrics::Registry* registry) : registry_(registry) {
  compute_ = registry->AddHistogram(names::kPrefillComputeSeconds,
                                    "Model forward over one prompt (all layers).",
                                    metrics::LatencyBuckets());
  transfer_tail_ = registry->AddHistogram(
      names::kPrefillTransferTailSeconds,
      "End of all computation to the last KV put flushed: transfer time not hidden by compute.",
      metrics::LatencyBuckets());
  transfer_ = registry->AddHistogram(names::kTransferSeconds,
                                     "One request's KV transfer, first put to last put flushed.",
                                     metrics::LatencyBuckets());
}

PrefillNodeMetrics::~PrefillNodeMetrics() { Detach(); }

void PrefillNodeMetrics::Attach(const PrefillServiceImpl* service) {
  absl::MutexLock lock(&mu_);
  auto gauge = [&](const char* name, const char* help, std::function<double()> read) {
    registry_->AddGaugeCallback(name, help, {}, std::move(read));
    attached_.emplace_back(name, metrics::Labels{});
  };
  auto counter = [&](const char* name, const char* help, metrics::Labels labels,
                     std::function<double()> read) {
    registry_->AddCounterCallback(name, help, labels, std::move(read));
    attached_.emplace_back(name, std::move(labels));
  };
  gauge(names::kPrefillRequestsQueued, "Prefill calls waiting for the compute slot.",
        [service] { return static_cast<double>(service->Load().queued_requests()); });
  gauge(names::kPrefillPromptTokensQueued, "Prompt tokens of the queued calls.",
        [service] { return static_cast<double>(service->Load().queued_prompt_tokens()); });
  gauge(names::kPrefillRequestsRunning, "Prefill calls computing or transferring.",
        [service] { return static_cast<double>(service->Load().running_requests()); });
  counter(names::kPrefillPromptTokensTotal, "Prompt tokens of successful Prefill calls.", {},
          [service] { return static_cast<double>(service->metrics().prompt_tokens); });
  counter(names::kTransferBytesTotal,
          "KV and sparse-state bytes moved by KV transfers (batches that completed).",
          {{"direction", "sent"}},
          [service] { return static_cast<double>(service->metrics().transport.bytes_written); });
  counter(names::kPrefillStagingSlotsTotal,
          "Staging-ring slots of KV pages staged and sent (prefill/staging_ring.h).", {},
          [service] { return static_cast<double>(service->metrics().staging.slots); });
  const char* full_help =
      "Times the staging ring had no room: during the compute (the pages waited, the compute did "
      "not) or in a request's drain after it (the request waited for its own writes).";
  counter(names::kPrefillStagingFullTotal, full_help, {{"when", "compute"}},
          [service] { return static_cast<double>(service->metrics().staging.deferred); });
  counter(names::kPrefillStagingFullTotal, full_help, {{"when", "drain"}},
          [service] { return static_cast<double>(service->metrics().staging.drain_waits); });
  // The transport's failure counts, by the cause labels of docs/METRICS.md.
  const char* failures_help = "Failed KV transfers, by cause (the transport's own counts).";
  auto failures = [&](const char* cause,
                      std::function<uint64_t(const transfer::TransportMetrics&)> read) {
    counter(names::kTransferFailuresTotal, failures_help, {{"cause", cause}},
            [service, read] { return static_cast<double>(read(service->metrics().transport)); });
  };
  failures("peer_unreachable", [](const auto& t) { return t.failed_unavailable; });
  failures("deadline", [](const auto& t) { return t.failed_deadline; });
  failures("rejected",
           [](const auto& t) { return t.failed_invalid_argument + t.failed_incompatible; });
  failures("other", [](const auto& t) { return t.failed_other; });
}

void PrefillNodeMetrics::Detach() {
  absl::MutexLock lock(&mu_);
  for (const auto& [name, labels] : attached_) registry_->Remove(name, labels);
  attached_.clear();
}

void PrefillNodeMetrics::OnRequestDone(int grpc_code) {
  registry_
      ->AddCounter(names::kPrefillRequestsTotal, "Prefill calls by final gRPC status.",
                   {{"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(grpc_code))}})
      ->Increment();
}

void PrefillNodeMetrics::OnComputed(const fluxion::v1::PrefillTiming& timing) {
  compute_->Observe(timing.compute_us() * 1e-6);
  transfer_tail_->Observe(timing.transfer_tail_us() * 1e-6);
  transfer_->Observe(timing.transfer_us() * 1e-6);
}

}  // namespace fluxion::prefill
