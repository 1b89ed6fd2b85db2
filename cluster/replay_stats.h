// What `fluxion replay` measures per request, and the statistics it reports over a run. The
// definitions follow vLLM's benchmark (`vllm bench serve`) and aiperf; docs/REPLAY.md states them.
//
// Thread-compatible: plain values and pure functions.
#ifndef FLUXION_CLUSTER_REPLAY_STATS_H_
#define FLUXION_CLUSTER_REPLAY_STATS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fluxion::cluster {

// One request as the client saw it. Times are seconds since the run started (steady clock).
struct RequestRecord {
  int64_t index = 0;            // position in the schedule
  std::string request_id;
  double scheduled_s = 0;       // when the schedule wanted it sent
  double start_s = 0;           // when it was sent
  double end_s = 0;             // when the stream ended
  // Arrival time and token count of every chunk that carried tokens, in order.
  std::vector<double> chunk_times_s;
  std::vector<int32_t> chunk_tokens;
  int64_t input_tokens = 0;
  int64_t requested_output_tokens = 0;
  int64_t output_tokens = 0;    // tokens received
  // The token ids received, in order; kept only when ReplayOptions::keep_output_ids is set (the
  // answer check of --distinct-prompts), else empty.
  std::vector<uint32_t> output_ids;
  int status_code = 0;          // final gRPC status code (0 = OK)
  std::string status_message;
  // The replayer cancelled it on purpose (--cancel-fraction): not a failure; reported apart.
  bool cancelled_by_client = false;

  bool ok() const { return status_code == 0; }
  bool has_first_token() const { return !chunk_times_s.empty(); }
};

// mean/std/min/max and percentiles (linear interpolation between order statistics, as numpy's
// default, which vLLM's benchmark uses). All zero when count is 0.
struct Distribution {
  int64_t count = 0;
  double mean = 0, std = 0, min = 0, max = 0, p50 = 0, p90 = 0, p99 = 0;
};
Distribution Summarize(std::vector<double> values);
// The q-th percentile (q in [0, 100]) of sorted values, linear interpolation. REQUIRES: non-empty.
double Percentile(const std::vector<double>& sorted, double q);

// Service-level objectives for goodput, in milliseconds; 0 means "no objective on this metric".
struct Slo {
  double ttft_ms = 0;
  double tpot_ms = 0;
  double e2e_ms = 0;
  bool any() const { return ttft_ms > 0 || tpot_ms > 0 || e2e_ms > 0; }
};

// One point of the timeline: throughput and concurrency in [t, t + bucket).
struct TimelinePoint {
  double t_s = 0;
  double output_tokens_per_s = 0;   // tokens received in the bucket / bucket
  double completed_per_s = 0;       // successful requests ending in the bucket / bucket
  double inflight = 0;              // requests sent and not ended, at t (time-averaged)
};

struct ReplayStats {
  int64_t requests = 0;
  int64_t succeeded = 0;
  int64_t failed = 0;
  int64_t cancelled = 0;  // cancelled on purpose by the replayer; in no other count
  std::map<std::string, int64_t> errors_by_code;  // gRPC code name -> count, failures only
  double duration_s = 0;  // first send to last end
  // Over successful requests, in milliseconds.
  Distribution ttft_ms, tpot_ms, itl_ms, e2e_ms;
  int64_t input_tokens = 0, output_tokens = 0;  // successful requests only
  double request_throughput = 0;       // successful requests / duration
  double output_token_throughput = 0;  // output tokens of successful requests / duration
  double total_token_throughput = 0;   // (input + output) tokens of successful requests / duration
  Slo slo;
  int64_t good_requests = 0;  // successful and within every set objective
  double goodput = 0;         // good_requests / duration (requests per second)
  // good_requests / (requests - cancelled): failed requests count as misses.
  double slo_attainment = 0;
  double timeline_bucket_s = 0;
  std::vector<TimelinePoint> timeline;
};

// Computes the report. `timeline_bucket_s` <= 0 picks a bucket giving about 50 points.
ReplayStats ComputeStats(const std::vector<RequestRecord>& records, const Slo& slo,
                         double timeline_bucket_s = 0);

// Per-request derived values, shared by the report, the CSV and the plots (milliseconds; -1 when
// undefined, e.g. TPOT of a one-token answer).
double TtftMs(const RequestRecord& r);
double E2eMs(const RequestRecord& r);
double TpotMs(const RequestRecord& r);
// Gaps between consecutive token-carrying chunks of one request.
std::vector<double> ItlMs(const RequestRecord& r);

// "OK", "UNAVAILABLE", ... for a gRPC status code number.
std::string StatusCodeName(int code);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_REPLAY_STATS_H_
