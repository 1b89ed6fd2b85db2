// Shared pieces of the measuring commands: machine description, the host read-bandwidth probe,
// statistics over repeats, and the result-file envelope.
#ifndef FLUXION_BENCH_BENCH_UTIL_H_
#define FLUXION_BENCH_BENCH_UTIL_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/read_bandwidth.h"
#include "nlohmann/json.hpp"

namespace fluxion::bench {

// "CPU model, N cores, M GiB, OS" read from /proc and /etc/os-release.
std::string MachineDescription();

using common::MeasureReadBandwidthGbps;  // common/read_bandwidth.h

struct Stats {
  double median = 0, p10 = 0, p90 = 0, min = 0, max = 0;
};
Stats Summarize(std::vector<double> samples);

// The result-file envelope of docs/BENCHMARKS.md around `results`.
nlohmann::json ResultEnvelope(const std::string& command, const nlohmann::json& limits,
                              const nlohmann::json& results);

// Writes `doc` (pretty-printed) to `path`; Internal naming the path on failure.
absl::Status WriteJson(const std::string& path, const nlohmann::json& doc);

// The command line as typed, for result files.
std::string JoinCommand(const std::string& prefix, const std::vector<std::string>& args);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_BENCH_UTIL_H_
