#include "cluster/replay_sampler.h"

#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "fluxion/v1/decode.grpc.pb.h"

namespace fluxion::cluster {
namespace {

namespace v1 = ::fluxion::v1;

v1::DecodeService::Stub* StubOf(const std::shared_ptr<void>& p) {
  return static_cast<v1::DecodeService::Stub*>(p.get());
}

bool Idle(const LoadSample& l) {
  return l.ok && l.running == 0 && l.prefilling == 0 && l.waiting == 0;
}

// Flat: the last sample within 10% or 16 MiB (whichever is larger) of the first after warm-up,
// so allocator noise does not count but a leak of a page or a buffer per request over a soak does.
bool RssFlat(const ProcessTrend& p) {
  const int64_t slack = std::max<int64_t>(p.rss_after_warmup / 10, int64_t{16} << 20);
  return p.rss_last <= p.rss_after_warmup + slack;
}

// Threads: gRPC grows and shrinks its pools with load; more than 4 above the post-warm-up count
// at the end (the load is over by then) is a leak.
bool ThreadsFlat(const ProcessTrend& p) { return p.threads_last <= p.threads_after_warmup + 4; }

}  // namespace

absl::StatusOr<std::vector<SampledProcess>> ParseSamplePids(absl::string_view flag) {
  std::vector<SampledProcess> out;
  std::set<std::string> names;
  if (flag.empty()) return out;
  for (absl::string_view entry : absl::StrSplit(flag, ',')) {
    std::vector<absl::string_view> kv = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    int pid = 0;
    if (kv.size() != 2 || kv[0].empty() || !absl::SimpleAtoi(kv[1], &pid) || pid <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sample-pids: want name=pid[,name=pid...] with pids > 0, got \"", entry, "\""));
    }
    if (!names.insert(std::string(kv[0])).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sample-pids: name \"", kv[0], "\" given twice"));
    }
    out.push_back({std::string(kv[0]), static_cast<pid_t>(pid)});
  }
  return out;
}

absl::StatusOr<ProcessUsage> ParseProcStatus(absl::string_view text) {
  ProcessUsage u;
  bool rss = false, threads = false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    int64_t v = 0;
    if (absl::ConsumePrefix(&line, "VmRSS:")) {
      line = absl::StripAsciiWhitespace(line);
      if (!absl::ConsumeSuffix(&line, " kB") ||
          !absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &v) || v < 0) {
        return absl::DataLossError("unparseable VmRSS line in /proc/<pid>/status");
      }
      u.rss_bytes = v * 1024;
      rss = true;
    } else if (absl::ConsumePrefix(&line, "Threads:")) {
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &v) || v <= 0) {
        return absl::DataLossError("unparseable Threads line in /proc/<pid>/status");
      }
      u.threads = v;
      threads = true;
    }
  }
  // A zombie has Threads but no VmRSS: it is gone as far as sampling is concerned.
  if (!rss || !threads) return absl::NotFoundError("no VmRSS/Threads (process exited)");
  return u;
}

absl::StatusOr<ProcessUsage> ReadProcessUsage(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  if (!in) return absl::NotFoundError(absl::StrCat("no process ", pid));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseProcStatus(ss.str());
}

ResourceSampler::ResourceSampler(SamplerOptions options) : options_(std::move(options)) {
  if (!options_.target.empty()) {
    stub_ = std::shared_ptr<v1::DecodeService::Stub>(
        v1::DecodeService::NewStub(serving::CreateChannel(options_.target, options_.channel)));
  }
}

ResourceSampler::~ResourceSampler() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_ != nullptr && thread_->joinable()) thread_->join();
}

LoadSample ResourceSampler::QueryLoad() {
  LoadSample s;
  s.t_s = absl::ToDoubleSeconds(absl::Now() - start_);
  if (stub_ == nullptr) return s;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::DecodeLoad load;
  if (!StubOf(stub_)->GetLoad(&context, v1::GetLoadRequest(), &load).ok()) return s;
  s.ok = true;
  s.free_kv_pages = load.free_kv_pages();
  s.total_kv_pages = load.total_kv_pages();
  s.running = load.running_requests();
  s.prefilling = load.prefilling_requests();
  s.waiting = load.waiting_requests();
  return s;
}

void ResourceSampler::SampleOnce(bool final_sample) {
  const double t = absl::ToDoubleSeconds(absl::Now() - start_);
  for (const SampledProcess& p : options_.processes) {
    ProcessSample s;
    s.t_s = t;
    auto usage = ReadProcessUsage(p.pid);
    s.alive = usage.ok();
    if (usage.ok()) s.usage = *usage;
    report_.process_samples.push_back({p.name, s});
  }
  if (stub_ != nullptr) {
    LoadSample l = QueryLoad();
    if (report_.load_samples.empty()) report_.first_load = l;
    if (final_sample) report_.final_load = l;
    report_.load_samples.push_back(l);
  }
}

void ResourceSampler::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(options_.interval)) SampleOnce(false);
}

void ResourceSampler::Start() {
  start_ = absl::Now();
  if (stub_ != nullptr) {
    // The page baseline needs an answer that counts pages: a router answers 0/0 while it sees no
    // healthy decode node (a health check missed on a loaded machine). Wait up to `settle` for
    // one, so that the run also starts on a router that is ready.
    const absl::Time deadline = absl::Now() + options_.settle;
    while (absl::Now() < deadline) {
      LoadSample l = QueryLoad();
      if (l.ok && l.total_kv_pages > 0) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
  }
  SampleOnce(false);
  thread_ = std::make_unique<std::thread>([this] { Loop(); });
}

SamplerReport ResourceSampler::Finish() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_ != nullptr && thread_->joinable()) thread_->join();
  if (stub_ != nullptr) {
    // Wait for the target to go idle and its pages to come back (quarantined ones included)
    // before the final sample; up to `settle`.
    const absl::Time deadline = absl::Now() + options_.settle;
    while (absl::Now() < deadline) {
      LoadSample l = QueryLoad();
      if (Idle(l) && l.free_kv_pages == report_.first_load.free_kv_pages) break;
      absl::SleepFor(absl::Milliseconds(500));
    }
  }
  SampleOnce(true);

  const double warmup_s = absl::ToDoubleSeconds(options_.warmup);
  std::map<std::string, ProcessTrend> trends;
  for (const SampledProcess& p : options_.processes) trends[p.name] = {p.name, p.pid};
  for (const auto& [name, s] : report_.process_samples) {
    ProcessTrend& t = trends[name];
    ++t.samples;
    if (!s.alive) {
      t.died = true;
      continue;
    }
    if (s.t_s < warmup_s) continue;
    if (t.rss_after_warmup == 0) {
      t.rss_after_warmup = s.usage.rss_bytes;
      t.threads_after_warmup = s.usage.threads;
    }
    t.rss_last = s.usage.rss_bytes;
    t.threads_last = s.usage.threads;
    t.rss_max_after_warmup = std::max(t.rss_max_after_warmup, s.usage.rss_bytes);
    t.threads_max_after_warmup = std::max(t.threads_max_after_warmup, s.usage.threads);
  }
  for (const SampledProcess& p : options_.processes) report_.processes.push_back(trends[p.name]);
  report_.have_load = stub_ != nullptr;
  report_.pages_back_to_baseline =
      report_.have_load && report_.first_load.ok && report_.final_load.ok &&
      report_.final_load.total_kv_pages == report_.first_load.total_kv_pages &&
      report_.final_load.free_kv_pages == report_.first_load.free_kv_pages;
  return report_;
}

std::string FormatSamplerReport(const SamplerReport& r, absl::Duration warmup) {
  std::string out = absl::StrFormat(
      "resources (after a %s warm-up; flat = last RSS within max(10%%, 16 MiB) and threads within "
      "+4 of the first sample after it):\n",
      absl::FormatDuration(warmup));
  absl::StrAppendFormat(&out, "  %-12s %7s %8s %10s %10s %10s %8s %8s %8s  %s\n", "process", "pid",
                        "samples", "RSS0 MiB", "RSSmax MiB", "RSSend MiB", "thr0", "thrmax",
                        "thrend", "verdict");
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  for (const ProcessTrend& p : r.processes) {
    std::string verdict = p.died ? "DIED"
                          : p.rss_after_warmup == 0
                              ? "no sample after warm-up"
                              : absl::StrCat(RssFlat(p) ? "RSS flat" : "RSS GREW", ", ",
                                             ThreadsFlat(p) ? "threads flat" : "threads GREW");
    absl::StrAppendFormat(&out, "  %-12s %7d %8d %10.1f %10.1f %10.1f %8d %8d %8d  %s\n", p.name,
                          p.pid, p.samples, mib(p.rss_after_warmup), mib(p.rss_max_after_warmup),
                          mib(p.rss_last), p.threads_after_warmup, p.threads_max_after_warmup,
                          p.threads_last, verdict);
  }
  if (r.have_load) {
    absl::StrAppendFormat(
        &out,
        "  KV pages free/total at start %d/%d, after the run %d/%d (running %d, prefilling %d, "
        "waiting %d): %s\n",
        r.first_load.free_kv_pages, r.first_load.total_kv_pages, r.final_load.free_kv_pages,
        r.final_load.total_kv_pages, r.final_load.running, r.final_load.prefilling,
        r.final_load.waiting,
        r.pages_back_to_baseline ? "back to baseline" : "NOT back to baseline");
  }
  return out;
}

nlohmann::json SamplerReportToJson(const SamplerReport& r, absl::Duration warmup) {
  nlohmann::json processes = nlohmann::json::array();
  for (const ProcessTrend& p : r.processes) {
    processes.push_back({{"name", p.name},
                         {"pid", p.pid},
                         {"samples", p.samples},
                         {"died", p.died},
                         {"rss_bytes_after_warmup", p.rss_after_warmup},
                         {"rss_bytes_max_after_warmup", p.rss_max_after_warmup},
                         {"rss_bytes_last", p.rss_last},
                         {"threads_after_warmup", p.threads_after_warmup},
                         {"threads_max_after_warmup", p.threads_max_after_warmup},
                         {"threads_last", p.threads_last},
                         {"rss_flat", !p.died && p.rss_after_warmup > 0 && RssFlat(p)},
                         {"threads_flat", !p.died && p.rss_after_warmup > 0 && ThreadsFlat(p)}});
  }
  auto load = [](const LoadSample& l) {
    return nlohmann::json{{"t_s", l.t_s},
                          {"ok", l.ok},
                          {"free_kv_pages", l.free_kv_pages},
                          {"total_kv_pages", l.total_kv_pages},
                          {"running", l.running},
                          {"prefilling", l.prefilling},
                          {"waiting", l.waiting}};
  };
  nlohmann::json out = {{"warmup_s", absl::ToDoubleSeconds(warmup)}, {"processes", processes}};
  if (r.have_load) {
    out["first_load"] = load(r.first_load);
    out["final_load"] = load(r.final_load);
    out["pages_back_to_baseline"] = r.pages_back_to_baseline;
  }
  return out;
}

absl::Status WriteSamplesCsv(const std::string& path, const SamplerReport& r) {
  std::ofstream out(path);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  out << "t_s,kind,name,rss_bytes,threads,free_kv_pages,total_kv_pages,running,prefilling,"
         "waiting\n";
  for (const auto& [name, s] : r.process_samples) {
    out << absl::StrFormat("%.3f,process,%s,%d,%d,,,,,\n", s.t_s, name,
                           s.alive ? s.usage.rss_bytes : -1, s.alive ? s.usage.threads : -1);
  }
  for (const LoadSample& l : r.load_samples) {
    if (!l.ok) continue;
    out << absl::StrFormat("%.3f,load,target,,,%d,%d,%d,%d,%d\n", l.t_s, l.free_kv_pages,
                           l.total_kv_pages, l.running, l.prefilling, l.waiting);
  }
  out.flush();
  if (!out) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace fluxion::cluster
