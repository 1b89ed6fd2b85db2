#include "cluster/replay_command.h"

#include <cmath>
#include <iostream>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cluster/replay_integrity.h"
#include "cluster/replay_report.h"
#include "cluster/replay_run.h"
#include "cluster/replay_sampler.h"
#include "cluster/replayer.h"
#include "cluster/trace.h"
#include "common/flag_set.h"
#include "common/grpc_security.h"
#include "common/status_macros.h"

namespace fluxion::cluster {
namespace {

// The checks no library function owns: the flags only this command reads, and the int64 flags
// that are narrowed on the way into ReplayOptions (--vocab-size 4294967298 would become 2).
absl::Status ValidateCommandFlags(int64_t vocab_size, double temperature, double budget,
                                  const Slo& slo, double bucket_s, const std::string& plot_format) {
  auto bad = [](absl::string_view flag, auto value, absl::string_view range) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " must be ", range, ", got ", value));
  };
  if (vocab_size < 2 || vocab_size > int64_t{kMaxReplayVocabSize}) {
    return bad("--vocab-size", vocab_size, absl::StrCat("in [2, ", kMaxReplayVocabSize, "]"));
  }
  if (!std::isfinite(temperature) || temperature < 0 || temperature > 100) {
    return bad("--temperature", temperature, "in [0, 100]");
  }
  if (!std::isfinite(budget) || budget < 0) {
    return bad("--budget", budget, "finite and >= 0 (0 = the policy's default)");
  }
  for (const auto& [flag, value] : {std::pair<const char*, double>{"--slo-ttft-ms", slo.ttft_ms},
                                    {"--slo-tpot-ms", slo.tpot_ms},
                                    {"--slo-e2e-ms", slo.e2e_ms},
                                    {"--timeline-bucket-s", bucket_s}}) {
    if (!std::isfinite(value) || value < 0 || value > 1e12) {
      return bad(flag, value, "in [0, 1e12] (0 = none)");
    }
  }
  if (plot_format != "png" && plot_format != "svg") {
    return absl::InvalidArgumentError(
        absl::StrCat("--plot-format must be png or svg, got '", plot_format, "'"));
  }
  return absl::OkStatus();
}

// The soak sampler of --sample-interval-s, started (null when sampling is off), or
// INVALID_ARGUMENT naming the flag.
absl::StatusOr<std::unique_ptr<ResourceSampler>> StartSampler(
    const std::string& pids, double interval_s, double warmup_s, double settle_s,
    const std::string& target, const serving::ChannelConfig& channel) {
  auto sampled = ParseSamplePids(pids);
  if (!sampled.ok()) return sampled.status();
  for (const auto& [flag, value] :
       {std::pair<const char*, double>{"--sample-interval-s", interval_s},
        {"--sample-warmup-s", warmup_s},
        {"--sample-settle-s", settle_s}}) {
    if (!std::isfinite(value) || value < 0 || value > kMaxReplayTimeoutS) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " must be in [0, ", kMaxReplayTimeoutS, "], got ", value));
    }
  }
  if (!sampled->empty() && interval_s == 0) {
    return absl::InvalidArgumentError("--sample-pids needs --sample-interval-s > 0");
  }
  if (interval_s == 0) return std::unique_ptr<ResourceSampler>();
  SamplerOptions options;
  options.processes = *sampled;
  options.target = target;
  options.channel = channel;
  options.interval = absl::Seconds(interval_s);
  options.warmup = absl::Seconds(warmup_s);
  options.settle = absl::Seconds(settle_s);
  auto sampler = std::make_unique<ResourceSampler>(std::move(options));
  sampler->Start();
  return sampler;
}

// Every flag of `fluxion replay`.
struct ReplayFlags {
  std::string target, trace, json_path, out_dir, policy;
  std::string plot_format = "png", input_len = "fixed:256", output_len = "fixed:32";
  bool synthetic = false, progress = true;
  int64_t num_requests = 100, concurrency = 0, max_inflight = 0, vocab_size = 256, seed = 1;
  int64_t distinct_prompts = 0;
  double rate = 1.0, timeout_s = 600, temperature = 0, budget = 0, bucket_s = 0;
  double cancel_fraction = 0, cancel_after_s = 1;
  TraceTransform transform;
  Slo slo;
  std::string sample_pids;
  double sample_interval_s = 0, sample_warmup_s = 60, sample_settle_s = 60;
  serving::ClientTlsOptions tls;
};

void RegisterLoadFlags(FlagSet& flags, ReplayFlags& f) {
  flags.String("target", &f.target, "host:port of the router or decode node (fluxion.v1 Generate)");
  flags.String("trace", &f.trace,
               "Mooncake JSONL trace (timestamp ms, input/output_length, hash_ids)");
  flags.Bool("synthetic", &f.synthetic, "generate load instead of reading a trace");
  flags.Int("num-requests", &f.num_requests, "synthetic: number of requests");
  flags.Double("rate", &f.rate, "synthetic: Poisson arrival rate (req/s); 0 = all at once");
  flags.String("input-len", &f.input_len,
               "synthetic prompt lengths: fixed:N, uniform:MIN:MAX, normal:MEAN:STD, "
               "exponential:MEAN");
  flags.String("output-len", &f.output_len, "synthetic output lengths (same forms as --input-len)");
  flags.Int("seed", &f.seed, "seed for synthetic load and sub-sampling");
  flags.Int("distinct-prompts", &f.distinct_prompts,
            "synthetic: draw every request from this many prompts and check that answers to the "
            "same prompt are the same tokens (needs --temperature 0; 0 = every prompt its own)");
  flags.Int("concurrency", &f.concurrency,
            "keep exactly this many requests in flight, ignoring arrival times (0 = honour times)");
  flags.Int("max-inflight", &f.max_inflight, "timed mode: hold arrivals while this many are open");
  TraceTransform& t = f.transform;
  flags.Double("time-scale", &t.time_scale, "multiply arrival times (10 = 10x slower)");
  flags.Double("length-scale", &t.length_scale,
               "multiply input/output lengths and the 512-token block (keeps prefix sharing)");
  flags.Int("max-input-tokens", &t.max_input_tokens, "truncate longer prompts (0 = no cap)");
  flags.Int("max-output-tokens", &t.max_output_tokens, "cap output lengths (0 = no cap)");
  flags.Double("sample", &t.sample_fraction, "keep each request with this probability");
  flags.Int("max-requests", &t.max_requests, "keep only the first N requests (0 = all)");
  flags.Double("start-s", &t.start_s, "skip trace requests before this time (s)");
  flags.Double("duration-s", &t.duration_s, "keep trace requests up to start+duration (s)");
}

void RegisterRequestAndReportFlags(FlagSet& flags, ReplayFlags& f) {
  flags.Int("vocab-size", &f.vocab_size, "prompt token ids are drawn from [1, vocab-size)");
  flags.Double("temperature", &f.temperature, "sampling temperature (0 = greedy)");
  flags.String("policy", &f.policy, "sparse attention policy (empty = the server's default)");
  flags.Double("budget", &f.budget, "sparse budget (0 = the policy's default)");
  flags.Double("timeout-s", &f.timeout_s, "per-request time budget (timeout_ms and gRPC deadline)");
  flags.Double("cancel-fraction", &f.cancel_fraction,
               "cancel this fraction of requests (seeded) --cancel-after-s after sending them");
  flags.Double("cancel-after-s", &f.cancel_after_s, "delay before a chosen request is cancelled");
  flags.Double("slo-ttft-ms", &f.slo.ttft_ms, "goodput objective on TTFT (0 = none)");
  flags.Double("slo-tpot-ms", &f.slo.tpot_ms, "goodput objective on TPOT (0 = none)");
  flags.Double("slo-e2e-ms", &f.slo.e2e_ms, "goodput objective on end-to-end latency (0 = none)");
  flags.String("json", &f.json_path, "write the summary as JSON to this file");
  flags.String("out-dir", &f.out_dir,
               "write summary.json, requests.csv, timeline.csv and plots into this directory");
  flags.String("plot-format", &f.plot_format, "png or svg");
  flags.Double("timeline-bucket-s", &f.bucket_s, "timeline resolution (0 = about 50 points)");
  flags.Double("sample-interval-s", &f.sample_interval_s,
               "soak sampling: every this many seconds read the --sample-pids processes' RSS and "
               "threads (/proc) and the target's GetLoad page counters; 0 = off");
  flags.String("sample-pids", &f.sample_pids,
               "soak sampling: name=pid[,name=pid...] of processes on this machine to sample");
  flags.Double("sample-warmup-s", &f.sample_warmup_s,
               "soak sampling: RSS and threads must stay flat after this much of the run");
  flags.Double("sample-settle-s", &f.sample_settle_s,
               "soak sampling: after the run, wait up to this long for the target to go idle and "
               "its KV pages to come back before the final sample");
  flags.Bool("progress", &f.progress, "show a live progress line on stderr (--noprogress to hide)");
  serving::RegisterClientTlsFlags(flags, "tls", "the target", &f.tls);
}

// The usage checks before any file is read.
absl::Status CheckFlags(const ReplayFlags& f) {
  if (f.trace.empty() == !f.synthetic) {
    return absl::InvalidArgumentError("give exactly one of --trace FILE and --synthetic");
  }
  if (f.distinct_prompts != 0 && (!f.synthetic || f.temperature != 0)) {
    return absl::InvalidArgumentError(
        "--distinct-prompts compares answers token for token, so it needs --synthetic and "
        "greedy sampling (--temperature 0)");
  }
  return ValidateCommandFlags(f.vocab_size, f.temperature, f.budget, f.slo, f.bucket_s,
                              f.plot_format);
}

// The --synthetic load, described in `run`; InvalidArgument for bad flags.
absl::StatusOr<Schedule> SyntheticSource(const ReplayFlags& f, RunDescription* run) {
  SyntheticOptions options;
  FLUXION_ASSIGN_OR_RETURN(options.input, ParseLengthDistribution(f.input_len));
  FLUXION_ASSIGN_OR_RETURN(options.output, ParseLengthDistribution(f.output_len));
  options.num_requests = f.num_requests;
  options.rate = f.rate;
  options.seed = static_cast<uint64_t>(f.seed);
  options.distinct_prompts = f.distinct_prompts;
  FLUXION_RETURN_IF_ERROR(ValidateSyntheticOptions(options));
  run->config["source"] = absl::StrFormat(
      "synthetic: %d requests, %s, input %s, output %s, seed %d%s", f.num_requests,
      f.rate > 0 ? absl::StrFormat("Poisson %g req/s", f.rate) : std::string("all at t=0"),
      f.input_len, f.output_len, f.seed,
      f.distinct_prompts > 0 ? absl::StrFormat(", %d distinct prompts", f.distinct_prompts) : "");
  return MakeSyntheticSchedule(options);
}

// The replayer's options from the flags, and the run's description for the report.
ReplayOptions MakeReplayOptions(const ReplayFlags& f, const serving::ChannelConfig& channel,
                                const Schedule& schedule, const std::vector<std::string>& args,
                                RunDescription* run) {
  ReplayOptions options;
  options.target = f.target;
  options.channel = channel;
  options.concurrency = f.concurrency;
  options.max_inflight = f.max_inflight;
  options.timeout_s = f.timeout_s;
  options.vocab_size = static_cast<uint32_t>(f.vocab_size);
  options.temperature = static_cast<float>(f.temperature);
  options.sparse_policy = f.policy;
  if (f.budget > 0) options.sparse_budget = static_cast<float>(f.budget);
  options.progress = f.progress;
  options.cancel_fraction = f.cancel_fraction;
  options.cancel_after_s = f.cancel_after_s;
  options.cancel_seed = static_cast<uint64_t>(f.seed);
  options.keep_output_ids = f.distinct_prompts > 0;
  nlohmann::json& config = run->config;
  config["target"] = f.target;
  config["mode"] = f.concurrency > 0
                       ? absl::StrCat("fixed concurrency ", f.concurrency)
                       : absl::StrCat("timed arrivals",
                                      f.max_inflight > 0
                                          ? absl::StrCat(", at most ", f.max_inflight, " in flight")
                                          : std::string());
  config["transforms"] = DescribeTransform(f.transform, schedule.block_tokens);
  config["block_tokens"] = schedule.block_tokens;
  config["vocab_size"] = f.vocab_size;
  config["temperature"] = f.temperature;
  config["policy"] = f.policy.empty() ? "server default" : f.policy;
  config["timeout_s"] = f.timeout_s;
  if (f.cancel_fraction > 0) {
    config["cancellation"] =
        absl::StrCat(f.cancel_fraction, " of requests after ", f.cancel_after_s, " s");
  }
  config["command"] = absl::StrCat("fluxion replay ", absl::StrJoin(args, " "));
  return options;
}

// The report, the repeated-answer check and the soak sampler's verdict. Returns the exit code: 1
// when a request failed, an output could not be written, answers to one prompt differed, a
// sampled process died or the pages did not come back.
int Report(const ReplayFlags& f, const ReplayOptions& options, const Schedule& schedule,
           const std::vector<RequestRecord>& records, const RunDescription& run,
           ResourceSampler* sampler) {
  ReportOutputs outputs;
  std::optional<AnswerCheck> answers;
  if (options.keep_output_ids) {
    answers = CheckRepeatedAnswers(schedule, records, options.vocab_size);
    outputs.extra_summary["answer_check"] = AnswerCheckToJson(*answers);
  }
  std::optional<SamplerReport> resources;
  if (sampler != nullptr) {
    resources = sampler->Finish();
    outputs.extra_summary["resources"] =
        SamplerReportToJson(*resources, absl::Seconds(f.sample_warmup_s));
  }
  outputs.json_path = f.json_path;
  outputs.out_dir = f.out_dir;
  outputs.plot_format = f.plot_format;
  outputs.timeline_bucket_s = f.bucket_s;
  ReportResult result = ReportRun(records, run, f.slo, outputs);
  if (answers.has_value()) std::cout << FormatAnswerCheck(*answers);
  const bool answers_bad = answers.has_value() && answers->mismatched > 0;
  bool resources_bad = false;
  if (resources.has_value()) {
    std::cout << FormatSamplerReport(*resources, absl::Seconds(f.sample_warmup_s));
    if (!f.out_dir.empty()) {
      if (absl::Status s = WriteSamplesCsv(f.out_dir + "/samples.csv", *resources); !s.ok()) {
        std::cerr << "error: " << s.message() << "\n";
        result.write_failed = true;
      }
    }
    // A sampled process that died, or pages that did not come back, fail the run like a failed
    // request; RSS/thread growth is reported (the verdict column) for the reader to judge.
    for (const ProcessTrend& p : resources->processes) resources_bad |= p.died;
    resources_bad |= resources->have_load && !resources->pages_back_to_baseline;
  }
  return (result.stats.failed > 0 || result.write_failed || resources_bad || answers_bad) ? 1 : 0;
}

int UsageError(const absl::Status& s) {
  std::cerr << "error: " << s.message() << "\n";
  return 2;
}

}  // namespace

int RunReplayCommand(const std::vector<std::string>& args) {
  ReplayFlags f;
  FlagSet flags("fluxion replay",
                "Replays a Mooncake trace or synthetic load against a router or decode node and "
                "reports TTFT, TPOT, ITL, E2E, throughput and goodput (docs/REPLAY.md).");
  RegisterLoadFlags(flags, f);
  RegisterRequestAndReportFlags(flags, f);
  flags.Require("target");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  auto channel = serving::ClientChannelConfig(f.tls);
  if (!channel.ok()) return UsageError(channel.status());
  if (absl::Status s = CheckFlags(f); !s.ok()) return UsageError(s);
  f.transform.seed = static_cast<uint64_t>(f.seed);
  RunDescription run;
  Schedule source;
  if (f.synthetic) {
    absl::StatusOr<Schedule> synthetic = SyntheticSource(f, &run);
    if (!synthetic.ok()) return UsageError(synthetic.status());
    source = *std::move(synthetic);
  } else {
    auto loaded = LoadMooncakeTrace(f.trace);
    if (!loaded.ok()) {
      std::cerr << "error: " << loaded.status().message() << "\n";
      return 1;
    }
    source = std::move(*loaded);
    run.config["source"] = absl::StrCat("Mooncake trace ", f.trace);
  }
  auto schedule = ApplyTransform(source, f.transform, &run.transform);
  if (!schedule.ok()) return UsageError(schedule.status());
  if (schedule->requests.empty()) {
    return UsageError(absl::InvalidArgumentError("the schedule is empty after the transforms"));
  }
  const ReplayOptions options = MakeReplayOptions(f, *channel, *schedule, args, &run);
  if (absl::Status s = ValidateReplayOptions(options); !s.ok()) return UsageError(s);
  auto sampler = StartSampler(f.sample_pids, f.sample_interval_s, f.sample_warmup_s,
                              f.sample_settle_s, f.target, *channel);
  if (!sampler.ok()) return UsageError(sampler.status());
  Replayer replayer(options);
  absl::StatusOr<std::vector<RequestRecord>> records;
  {
    InterruptScope interrupt;
    InterruptScope::SetReplayer(&replayer);
    records = replayer.Run(*schedule);
    InterruptScope::SetReplayer(nullptr);
  }
  if (!records.ok()) {
    std::cerr << "error: " << records.status().message() << "\n";
    return 1;
  }
  return Report(f, options, *schedule, *records, run, sampler->get());
}

}  // namespace fluxion::cluster
