// Resource sampling for long replays (soaks): while `fluxion replay` runs, a thread reads every
// --sample-pids process's resident memory and thread count from /proc and the target's GetLoad
// (KV pages free/total, requests running, prefilling, waiting) every --sample-interval-s, and
// once more after the run once the target is idle. The report says whether RSS and threads stayed
// flat after --sample-warmup-s and whether the page counters came back to where they started.
//
// /proc is read on this machine, so --sample-pids names processes on the replayer's host (the
// local cluster); GetLoad goes to the target wherever it is.
//
// Thread-safety: Start/Stop/results from one thread; the sampling thread owns the samples until
// Stop() returns.
#ifndef FLUXION_CLUSTER_REPLAY_SAMPLER_H_
#define FLUXION_CLUSTER_REPLAY_SAMPLER_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/grpc_transport.h"
#include "nlohmann/json.hpp"

namespace fluxion::cluster {

struct SampledProcess {
  std::string name;
  pid_t pid = 0;
};

// "router=123,decode-0=456" -> processes; INVALID_ARGUMENT naming --sample-pids on a malformed
// entry, a pid <= 0, or a name given twice.
absl::StatusOr<std::vector<SampledProcess>> ParseSamplePids(absl::string_view flag);

struct ProcessUsage {
  int64_t rss_bytes = 0;
  int64_t threads = 0;
};

// VmRSS and Threads of /proc/<pid>/status. NOT_FOUND when the process is gone.
absl::StatusOr<ProcessUsage> ReadProcessUsage(pid_t pid);
// The same fields parsed from the text of a status file (tested without /proc).
absl::StatusOr<ProcessUsage> ParseProcStatus(absl::string_view text);

struct ProcessSample {
  double t_s = 0;  // since the sampler started
  bool alive = false;
  ProcessUsage usage;
};

struct LoadSample {
  double t_s = 0;
  bool ok = false;  // GetLoad answered
  uint64_t free_kv_pages = 0, total_kv_pages = 0;
  uint32_t running = 0, prefilling = 0, waiting = 0;
};

struct SamplerOptions {
  std::vector<SampledProcess> processes;
  std::string target;  // GetLoad target; empty: no load samples
  serving::ChannelConfig channel;
  absl::Duration interval = absl::Seconds(10);
  absl::Duration warmup = absl::Seconds(60);
  // After the run: poll GetLoad up to this long for an idle target (no request running,
  // prefilling or waiting) before the final sample; quarantined pages come back only after the
  // decode nodes' --quarantine-ms.
  absl::Duration settle = absl::Seconds(60);
};

// What the samples say, per process and for the page counters.
struct ProcessTrend {
  std::string name;
  pid_t pid = 0;
  int samples = 0;
  bool died = false;             // a sample found the process gone
  int64_t rss_after_warmup = 0;  // first sample at or after the warm-up
  int64_t rss_last = 0, rss_max_after_warmup = 0;
  int64_t threads_after_warmup = 0, threads_last = 0, threads_max_after_warmup = 0;
};

struct SamplerReport {
  std::vector<ProcessTrend> processes;
  bool have_load = false;
  LoadSample first_load, final_load;    // before the first request; after the run settled
  bool pages_back_to_baseline = false;  // final free == first free and total unchanged
  std::vector<std::pair<std::string, ProcessSample>>
      process_samples;  // (name, sample) in time order
  std::vector<LoadSample> load_samples;
};

class ResourceSampler {
 public:
  explicit ResourceSampler(SamplerOptions options);
  ~ResourceSampler();  // Stop() if running
  ResourceSampler(const ResourceSampler&) = delete;
  ResourceSampler& operator=(const ResourceSampler&) = delete;

  // Waits (up to `settle`) until the target's GetLoad counts pages, takes the first sample, then
  // one every interval on a thread of its own.
  void Start();
  // Stops the thread, waits (up to `settle`) for an idle target, takes the final sample and
  // returns the report.
  SamplerReport Finish();

 private:
  void SampleOnce(bool final_sample);
  void Loop();
  LoadSample QueryLoad();

  SamplerOptions options_;
  absl::Time start_;
  std::unique_ptr<std::thread> thread_;
  absl::Notification stop_;
  std::shared_ptr<void> stub_;  // fluxion::v1::DecodeService::Stub, kept out of the header
  SamplerReport report_;
};

// A table: per process RSS (MiB) and threads after warm-up, last and max; page counters first
// and final; plus a line saying whether each is flat / back to baseline.
std::string FormatSamplerReport(const SamplerReport& report, absl::Duration warmup);
nlohmann::json SamplerReportToJson(const SamplerReport& report, absl::Duration warmup);
// samples.csv:
// t_s,kind,name,rss_bytes,threads,free_kv_pages,total_kv_pages,running,prefilling,waiting
absl::Status WriteSamplesCsv(const std::string& path, const SamplerReport& report);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_REPLAY_SAMPLER_H_
