// Pieces shared by `fluxion replay` and `fluxion local`: Ctrl-C handling around a run, and the
// report step (summary on stdout, JSON, CSV, plots).
#ifndef FLUXION_CLUSTER_REPLAY_RUN_H_
#define FLUXION_CLUSTER_REPLAY_RUN_H_

#include <string>
#include <vector>

#include "cluster/replay_report.h"
#include "cluster/replay_stats.h"
#include "cluster/replayer.h"
#include "cluster/trace.h"

namespace fluxion::cluster {

// While alive, SIGINT and SIGTERM set interrupted() and interrupt the replayer given to
// SetReplayer; a second signal has the default effect (the handler resets itself). Restores the
// previous handlers when destroyed. One at a time per process.
class InterruptScope {
 public:
  InterruptScope();
  ~InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;
  static bool interrupted();
  // `replayer` (or nullptr) must stay valid until replaced.
  static void SetReplayer(Replayer* replayer);
};

// "time x10, lengths x0.05 (block 26 tokens), ..." or "none".
std::string DescribeTransform(const TraceTransform& transform, int64_t block_tokens);

struct ReportOutputs {
  std::string json_path;    // summary JSON; empty: none
  std::string out_dir;      // summary.json, requests.csv, timeline.csv, plots/; empty: none
  std::string plot_format = "png";
  double timeline_bucket_s = 0;
  // Merged into the summary JSON (e.g. {"resources": ...} from --sample-interval-s).
  nlohmann::json extra_summary = nlohmann::json::object();
};

struct ReportResult {
  ReplayStats stats;
  std::vector<std::string> plots;  // image paths, when drawn
  bool write_failed = false;
};

// Computes the statistics, prints the summary table (and where files went) on stdout, writes the
// requested files. Problems writing are printed on stderr and flagged in write_failed.
ReportResult ReportRun(const std::vector<RequestRecord>& records, const RunDescription& run,
                       const Slo& slo, const ReportOutputs& outputs);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_REPLAY_RUN_H_
