// Output of `fluxion replay`: the summary table on stdout, JSON (summary), CSV (per request and
// timeline), and gnuplot plots (latency CDFs; throughput and in-flight requests over time).
//
// Thread-compatible: pure functions over finished records.
#ifndef FLUXION_CLUSTER_REPLAY_REPORT_H_
#define FLUXION_CLUSTER_REPLAY_REPORT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cluster/replay_stats.h"
#include "cluster/trace.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster {

// How the run was set up, reported beside its numbers: `config` holds the options as given
// (target, source, mode, scales, caps, SLOs, ...), `transform` what the transforms changed.
struct RunDescription {
  nlohmann::json config = nlohmann::json::object();
  TransformReport transform;
};

// The whole summary as JSON: config, transform, counts, errors by code, distributions (ms),
// throughput, goodput, timeline. Field names follow docs/BENCHMARKS.md where they overlap
// (ttft_ms, tpot_ms, tokens_per_s).
nlohmann::json StatsToJson(const ReplayStats& stats, const RunDescription& run);

// The human-readable table printed at the end of a run.
std::string FormatSummary(const ReplayStats& stats, const RunDescription& run);

// One row per request: id, times, tokens, TTFT/TPOT/E2E, status.
absl::Status WriteRequestsCsv(const std::string& path, const std::vector<RequestRecord>& records);
// One row per timeline bucket.
absl::Status WriteTimelineCsv(const std::string& path, const ReplayStats& stats);
absl::Status WriteJson(const std::string& path, const nlohmann::json& json);

// Writes the plot data and gnuplot scripts into `dir` and runs gnuplot: latency_cdf.<format>
// (TTFT, TPOT, ITL, E2E) and timeline.<format> (output tokens/s, completions/s, in-flight).
// `format` is "png" or "svg". Returns the image paths. FAILED_PRECONDITION when gnuplot is not
// installed (the data and scripts are still written, so the plots can be made later).
absl::StatusOr<std::vector<std::string>> RenderPlots(const std::string& dir,
                                                     const std::string& format,
                                                     const std::vector<RequestRecord>& records,
                                                     const ReplayStats& stats,
                                                     const std::string& title);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_REPLAY_REPORT_H_
