#include "cluster/replay_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/status/status.h"

namespace fluxion::cluster {

double Percentile(const std::vector<double>& sorted, double q) {
  if (sorted.size() == 1) return sorted[0];
  double rank = q / 100.0 * static_cast<double>(sorted.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(rank));
  size_t hi = std::min(lo + 1, sorted.size() - 1);
  double frac = rank - static_cast<double>(lo);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

Distribution Summarize(std::vector<double> values) {
  Distribution d;
  if (values.empty()) return d;
  std::sort(values.begin(), values.end());
  d.count = values.size();
  d.mean = std::accumulate(values.begin(), values.end(), 0.0) / d.count;
  double sq = 0;
  for (double v : values) sq += (v - d.mean) * (v - d.mean);
  d.std = std::sqrt(sq / d.count);  // population std, as numpy's default
  d.min = values.front();
  d.max = values.back();
  d.p50 = Percentile(values, 50);
  d.p90 = Percentile(values, 90);
  d.p99 = Percentile(values, 99);
  return d;
}

double TtftMs(const RequestRecord& r) {
  return r.has_first_token() ? (r.chunk_times_s.front() - r.start_s) * 1e3 : -1;
}

double E2eMs(const RequestRecord& r) { return (r.end_s - r.start_s) * 1e3; }

double TpotMs(const RequestRecord& r) {
  if (!r.has_first_token() || r.output_tokens < 2) return -1;
  return (E2eMs(r) - TtftMs(r)) / static_cast<double>(r.output_tokens - 1);
}

std::vector<double> ItlMs(const RequestRecord& r) {
  std::vector<double> gaps;
  for (size_t i = 1; i < r.chunk_times_s.size(); ++i) {
    gaps.push_back((r.chunk_times_s[i] - r.chunk_times_s[i - 1]) * 1e3);
  }
  return gaps;
}

std::string StatusCodeName(int code) {
  if (code < 0 || code > 16) return "CODE_" + std::to_string(code);
  std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  // absl spells them "UNAVAILABLE", "RESOURCE_EXHAUSTED", ... like gRPC.
  return name;
}

ReplayStats ComputeStats(const std::vector<RequestRecord>& records, const Slo& slo,
                         double timeline_bucket_s) {
  ReplayStats s;
  s.slo = slo;
  s.requests = records.size();
  if (records.empty()) return s;
  double first = records.front().start_s, last = records.front().end_s;
  std::vector<double> ttft, tpot, itl, e2e;
  for (const RequestRecord& r : records) {
    first = std::min(first, r.start_s);
    last = std::max(last, r.end_s);
    if (r.cancelled_by_client) {
      ++s.cancelled;
      continue;
    }
    if (!r.ok()) {
      ++s.failed;
      ++s.errors_by_code[StatusCodeName(r.status_code)];
      continue;
    }
    ++s.succeeded;
    s.input_tokens += r.input_tokens;
    s.output_tokens += r.output_tokens;
    double r_ttft = TtftMs(r), r_tpot = TpotMs(r), r_e2e = E2eMs(r);
    if (r_ttft >= 0) ttft.push_back(r_ttft);
    if (r_tpot >= 0) tpot.push_back(r_tpot);
    e2e.push_back(r_e2e);
    for (double gap : ItlMs(r)) itl.push_back(gap);
    // A request with no defined TPOT (one token) meets a TPOT objective vacuously, as in vLLM.
    bool good = (slo.ttft_ms <= 0 || (r_ttft >= 0 && r_ttft <= slo.ttft_ms)) &&
                (slo.tpot_ms <= 0 || r_tpot < 0 || r_tpot <= slo.tpot_ms) &&
                (slo.e2e_ms <= 0 || r_e2e <= slo.e2e_ms);
    if (good) ++s.good_requests;
  }
  s.duration_s = std::max(last - first, 1e-9);
  s.ttft_ms = Summarize(ttft);
  s.tpot_ms = Summarize(tpot);
  s.itl_ms = Summarize(itl);
  s.e2e_ms = Summarize(e2e);
  s.request_throughput = s.succeeded / s.duration_s;
  s.output_token_throughput = s.output_tokens / s.duration_s;
  s.total_token_throughput = (s.input_tokens + s.output_tokens) / s.duration_s;
  s.goodput = s.good_requests / s.duration_s;
  s.slo_attainment = s.requests > s.cancelled
                         ? static_cast<double>(s.good_requests) / (s.requests - s.cancelled)
                         : 0.0;

  // Timeline in fixed buckets from the first send.
  double bucket = timeline_bucket_s > 0 ? timeline_bucket_s : s.duration_s / 50.0;
  bucket = std::max(bucket, 1e-3);
  size_t n = static_cast<size_t>(std::ceil(s.duration_s / bucket));
  n = std::max<size_t>(n, 1);
  s.timeline_bucket_s = bucket;
  s.timeline.resize(n);
  for (size_t i = 0; i < n; ++i) s.timeline[i].t_s = i * bucket;
  auto index_of = [&](double t) {
    return std::min(n - 1, static_cast<size_t>(std::max(0.0, (t - first) / bucket)));
  };
  for (const RequestRecord& r : records) {
    for (size_t c = 0; c < r.chunk_times_s.size(); ++c) {
      s.timeline[index_of(r.chunk_times_s[c])].output_tokens_per_s += r.chunk_tokens[c] / bucket;
    }
    if (r.ok()) s.timeline[index_of(r.end_s)].completed_per_s += 1 / bucket;
    // Time-averaged concurrency: each request adds its overlap with the bucket.
    double a = r.start_s - first, b = r.end_s - first;
    for (size_t i = index_of(r.start_s); i < n && i * bucket < b; ++i) {
      double lo = std::max(a, i * bucket), hi = std::min(b, (i + 1) * bucket);
      if (hi > lo) s.timeline[i].inflight += (hi - lo) / bucket;
    }
  }
  return s;
}

}  // namespace fluxion::cluster
