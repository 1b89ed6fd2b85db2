#include "cluster/replay_run.h"

#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace fluxion::cluster {
namespace {

std::atomic<Replayer*> g_replayer{nullptr};
std::atomic<bool> g_interrupted{false};
struct sigaction g_previous_int, g_previous_term;

void OnInterrupt(int) {
  // Async-signal-safe: atomic loads and stores only.
  g_interrupted.store(true);
  if (Replayer* r = g_replayer.load()) r->Interrupt();
}

}  // namespace

InterruptScope::InterruptScope() {
  g_interrupted.store(false);
  struct sigaction action = {};
  action.sa_handler = OnInterrupt;
  action.sa_flags = SA_RESETHAND;
  sigaction(SIGINT, &action, &g_previous_int);
  sigaction(SIGTERM, &action, &g_previous_term);
}

InterruptScope::~InterruptScope() {
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
  g_replayer.store(nullptr);
}

bool InterruptScope::interrupted() { return g_interrupted.load(); }

void InterruptScope::SetReplayer(Replayer* replayer) {
  g_replayer.store(replayer);
  if (replayer != nullptr && g_interrupted.load()) replayer->Interrupt();
}

std::string DescribeTransform(const TraceTransform& t, int64_t block_tokens) {
  std::vector<std::string> parts;
  if (t.start_s > 0 || t.duration_s > 0) {
    parts.push_back(absl::StrFormat("window [%g s, %s)", t.start_s,
                                    t.duration_s > 0 ? absl::StrCat(t.start_s + t.duration_s, " s")
                                                     : std::string("end")));
  }
  if (t.sample_fraction < 1) {
    parts.push_back(absl::StrFormat("sample %g (seed %d)", t.sample_fraction, t.seed));
  }
  if (t.max_requests > 0) parts.push_back(absl::StrCat("first ", t.max_requests, " requests"));
  if (t.time_scale != 1) parts.push_back(absl::StrFormat("time x%g", t.time_scale));
  if (t.length_scale != 1) {
    parts.push_back(absl::StrFormat("lengths x%g (block %d tokens)", t.length_scale, block_tokens));
  }
  if (t.max_input_tokens > 0) parts.push_back(absl::StrCat("input cap ", t.max_input_tokens));
  if (t.max_output_tokens > 0) parts.push_back(absl::StrCat("output cap ", t.max_output_tokens));
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

ReportResult ReportRun(const std::vector<RequestRecord>& records, const RunDescription& run,
                       const Slo& slo, const ReportOutputs& outputs) {
  ReportResult result;
  result.stats = ComputeStats(records, slo, outputs.timeline_bucket_s);
  nlohmann::json summary = StatsToJson(result.stats, run);
  for (const auto& [key, value] : outputs.extra_summary.items()) summary[key] = value;
  std::cout << FormatSummary(result.stats, run);
  auto check = [&](const absl::Status& s) {
    if (!s.ok()) {
      std::cerr << "error: " << s.message() << "\n";
      result.write_failed = true;
    }
  };
  if (!outputs.json_path.empty()) check(WriteJson(outputs.json_path, summary));
  if (!outputs.out_dir.empty()) {
    const std::string& dir = outputs.out_dir;
    std::string mkdir = absl::StrCat("mkdir -p '", dir, "'");
    if (std::system(mkdir.c_str()) != 0) {
      check(absl::PermissionDeniedError(absl::StrCat("cannot create ", dir)));
    }
    check(WriteJson(dir + "/summary.json", summary));
    check(WriteRequestsCsv(dir + "/requests.csv", records));
    check(WriteTimelineCsv(dir + "/timeline.csv", result.stats));
    std::string title = run.config.contains("source") ? run.config["source"].get<std::string>()
                                                      : std::string("replay");
    auto plots = RenderPlots(dir + "/plots", outputs.plot_format, records, result.stats, title);
    if (plots.ok()) {
      result.plots = *plots;
      std::cout << "plots: " << absl::StrJoin(*plots, ", ") << "\n";
    } else {
      std::cerr << "plots skipped: " << plots.status().message() << "\n";
    }
    std::cout << "results: " << dir << "/{summary.json,requests.csv,timeline.csv}\n";
  }
  return result;
}

}  // namespace fluxion::cluster
