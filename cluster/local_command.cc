#include "cluster/local_command.h"

#include <ctime>
#include <iostream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cluster/local_cluster.h"
#include "cluster/openai_client.h"
#include "cluster/replay_run.h"
#include "cluster/replayer.h"
#include "cluster/trace.h"
#include "common/flag_set.h"
#include "common/served_model_name.h"
#include "common/status_macros.h"

namespace fluxion::cluster {
namespace {

// The closing request: a question in the form the bundled model was trained on (docs/TASKS.md,
// niah_single: a haystack of filler sentences with the needle among them, a blank line, the
// question and its answer prefix), so that a new user sees a right answer rather than whatever the
// tiny model makes of a chat turn it never saw (docs/CHAT.md, "Our own byte-level models"). It
// goes to the completions endpoint: the chat endpoint would wrap it in the plain template's
// "user: ... assistant: ", and the model answers from its trained form only. About 2K tokens:
// below ~1K the decode nodes' default policy (fluxion at a 5% budget) reads too few rows to copy
// the number.
constexpr size_t kClosingHaystackChars = 2000;
constexpr char kClosingNeedle[] = "The special magic number for satovire is 2390561.";
constexpr char kClosingQuestion[] = "What is the special magic number for satovire?";
constexpr char kClosingAnswerPrefix[] = "The special magic number for satovire is ";
constexpr char kClosingExpected[] = "2390561";

// docs/TASKS.md's haystack of about `chars` characters with `needle` after ~40% of it: filler
// sentences, half of them its fixed sentences and half 4-10 random words of 1-3 syllables. The
// seed is fixed (std::mt19937's sequence is the same everywhere), so every run asks the same.
std::string ClosingHaystack(size_t chars, const std::string& needle) {
  static constexpr const char* kFixed[] = {"The grass is green.",
                                           "The sky is blue.",
                                           "The sun is yellow.",
                                           "Here we go.",
                                           "There and back again.",
                                           "The river flows to the sea.",
                                           "A small bird sings in the tree.",
                                           "The old road winds through the hills."};
  static constexpr char kConsonants[] = "bdfgklmnprstvz";
  static constexpr char kVowels[] = "aeiou";
  std::mt19937 rng(43);
  auto uniform = [&rng](uint32_t lo, uint32_t hi) { return lo + rng() % (hi - lo + 1); };
  auto sentence = [&]() -> std::string {
    if (rng() % 2 == 0) return kFixed[uniform(0, 7)];
    std::vector<std::string> words(uniform(4, 10));
    for (std::string& w : words) {
      for (uint32_t n = uniform(1, 3); n > 0; --n) {
        w += kConsonants[uniform(0, 13)];
        w += kVowels[uniform(0, 4)];
      }
    }
    std::string out = absl::StrJoin(words, " ") + ".";
    out[0] = static_cast<char>(out[0] - 'a' + 'A');
    return out;
  };
  std::vector<std::string> sentences;
  bool placed = false;
  for (size_t length = 0; length < chars;) {
    if (!placed && length >= chars * 2 / 5) {
      sentences.push_back(needle);
      placed = true;
    } else {
      sentences.push_back(sentence());
    }
    length += sentences.back().size() + 1;
  }
  return absl::StrJoin(sentences, " ");
}

// One completion request through the HTTP API, to show text in and text out end to end: the
// question, the expected answer and the model's (its text up to the first newline, as
// docs/TASKS.md scores it). Informational: a failure is printed, not fatal (the replay above is
// the run's result).
void ShowOneAnswer(int http_port, const std::string& model_dir) {
  const std::string name = ServedModelName("", model_dir);
  const std::string prompt = absl::StrCat(ClosingHaystack(kClosingHaystackChars, kClosingNeedle),
                                          "\n\n", kClosingQuestion, " ", kClosingAnswerPrefix);
  auto answer = openai::AskOnce(http_port, name, prompt, /*chat=*/false, 16, absl::Seconds(60));
  std::cout << "one request through the HTTP API (POST /v1/completions, greedy), in the form the "
               "tiny model was trained on (docs/TASKS.md, niah_single: "
            << prompt.size() << " characters, the question after a haystack holding \""
            << kClosingNeedle << "\"):\n"
            << "  question: " << kClosingQuestion << "\n  expected: " << kClosingExpected << "\n";
  if (!answer.ok()) {
    std::cout << "  model:    (failed: " << answer.status().message() << ")\n";
    return;
  }
  const std::string text = answer->substr(0, answer->find('\n'));
  std::cout << "  model:    " << text << (text == kClosingExpected ? " (right)" : " (wrong)")
            << "\n";
}

// Every flag of `fluxion local`, defaults sized for a 2-core machine and the tiny model.
struct LocalOptions {
  LocalClusterOptions cluster;
  std::string trace, out_dir, json_path, policy;
  std::string plot_format = "png";
  int64_t vocab_size = 256;
  double timeout_s = 120;
  TraceTransform transform;
  Slo slo{5000, 500, 0};

  LocalOptions() {
    const std::string root = RepoRoot();
    cluster.model = root + "/models/fluxion-tiny-retrieval";
    trace = root + "/cluster/traces/mooncake_conversation_30s.jsonl";
    transform.max_requests = 24;
    transform.time_scale = 4;
    transform.length_scale = 1.0 / 32;
    transform.max_input_tokens = 1024;
    transform.max_output_tokens = 32;
  }
};

void RegisterFlags(FlagSet& flags, LocalOptions& o) {
  RegisterLocalClusterFlags(flags, &o.cluster);
  flags.String("trace", &o.trace, "Mooncake JSONL trace to replay");
  flags.String("policy", &o.policy, "sparse attention policy (empty: the decode nodes' default)");
  flags.Int("vocab-size", &o.vocab_size,
            "prompt token ids are drawn from [1, vocab-size) (256: the byte-level tiny model)");
  flags.Int("max-requests", &o.transform.max_requests, "replay the first N requests of the trace");
  flags.Double("sample", &o.transform.sample_fraction, "keep each request with this probability");
  flags.Double("time-scale", &o.transform.time_scale, "multiply arrival times (4 = 4x slower)");
  flags.Double("length-scale", &o.transform.length_scale,
               "multiply input/output lengths (and the 512-token block)");
  flags.Int("max-input-tokens", &o.transform.max_input_tokens, "cap prompt lengths");
  flags.Int("max-output-tokens", &o.transform.max_output_tokens, "cap output lengths");
  flags.Double("slo-ttft-ms", &o.slo.ttft_ms, "goodput objective on TTFT (0 = none)");
  flags.Double("slo-tpot-ms", &o.slo.tpot_ms, "goodput objective on TPOT (0 = none)");
  flags.Double("timeout-s", &o.timeout_s, "per-request time budget");
  flags.String("out-dir", &o.out_dir,
               "results and logs (default /tmp/fluxion-local-<time>): summary.json, CSV, plots/, "
               "logs/");
  flags.String("json", &o.json_path, "also write the summary JSON here");
  flags.String("plot-format", &o.plot_format, "png or svg");
}

// After parsing: every check. InvalidArgument (a usage error) names the flag.
absl::Status CheckOptions(const LocalOptions& o) {
  FLUXION_RETURN_IF_ERROR(CheckLocalClusterOptions(o.cluster));
  // Checked here, before the cast to the replayer's 32-bit field (4294967298 would become 2).
  if (o.vocab_size < 2 || o.vocab_size > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab-size must be in [2, 16777216], got ", o.vocab_size));
  }
  return absl::OkStatus();
}

void PrintReady(const LocalCluster& cluster, const std::string& trace, size_t requests) {
  std::cout << "cluster ready: router " << cluster.router_address() << ", prefill "
            << absl::StrJoin(cluster.prefill_addresses(), ",") << ", decode "
            << absl::StrJoin(cluster.decode_addresses(), ",") << "\n"
            << "OpenAI-compatible HTTP API: http://127.0.0.1:" << cluster.http_port() << "/v1\n"
            << "metrics (Prometheus text, while the cluster runs):\n  "
            << absl::StrJoin(cluster.metrics_urls(), "\n  ") << "\n"
            << "replaying " << requests << " requests of " << trace << "\n"
            << std::flush;
}

// The replay through the cluster's router, described in `run` for the report.
absl::StatusOr<std::vector<RequestRecord>> Replay(const LocalOptions& o,
                                                  const LocalCluster& cluster,
                                                  const Schedule& schedule,
                                                  const std::vector<std::string>& args,
                                                  RunDescription* run) {
  ReplayOptions options;
  options.target = cluster.router_address();
  options.timeout_s = o.timeout_s;
  options.sparse_policy = o.policy;
  options.vocab_size = static_cast<uint32_t>(o.vocab_size);
  options.request_id_prefix = absl::StrCat("local-", std::time(nullptr));
  run->config["target"] = cluster.router_address();
  run->config["source"] = absl::StrCat("Mooncake trace ", o.trace);
  run->config["mode"] = "timed arrivals";
  run->config["transforms"] = DescribeTransform(o.transform, schedule.block_tokens);
  const LocalClusterOptions& c = o.cluster;
  run->config["cluster"] =
      absl::StrCat(c.prefill_nodes, " prefill + ", c.decode_nodes, " decode + router, UCX ",
                   c.ucx_tls, ", ", c.cpu_threads, " thread(s) per node");
  run->config["policy"] = o.policy.empty() ? "decode default" : o.policy;
  run->config["command"] = absl::StrCat("fluxion local ", absl::StrJoin(args, " "));
  Replayer replayer(options);
  InterruptScope::SetReplayer(&replayer);
  auto records = replayer.Run(schedule);
  InterruptScope::SetReplayer(nullptr);
  return records;
}

// Starts the cluster, replays `schedule`, reports, asks the closing question, shuts down.
int RunLocal(const LocalOptions& o, const std::string& logs, const Schedule& schedule,
             RunDescription run, const std::vector<std::string>& args) {
  InterruptScope interrupt;  // Ctrl-C from here on: stop replaying, then shut the nodes down
  LocalCluster cluster(o.cluster, logs);
  auto fail = [&](const absl::Status& s) {
    std::cerr << "error: " << s.message() << "\nshutting down:\n";
    cluster.Shutdown();
    return s.code() == absl::StatusCode::kCancelled ? 130 : 1;
  };
  if (absl::Status s = cluster.Start(); !s.ok()) return fail(s);
  PrintReady(cluster, o.trace, schedule.requests.size());
  auto records = Replay(o, cluster, schedule, args, &run);
  if (!records.ok()) return fail(records.status());
  ReportOutputs outputs;
  outputs.out_dir = o.out_dir;
  outputs.json_path = o.json_path;
  outputs.plot_format = o.plot_format;
  std::cout << "cluster: " << run.config["cluster"].get<std::string>() << "\n";
  ReportResult result = ReportRun(*records, run, o.slo, outputs);
  ShowOneAnswer(cluster.http_port(), o.cluster.model);
  std::cout << "logs: " << logs << "/\nshutting down:\n";
  cluster.Shutdown();
  if (InterruptScope::interrupted()) return 130;
  return (result.stats.failed > 0 || result.write_failed) ? 1 : 0;
}

}  // namespace

int RunLocalCommand(const std::vector<std::string>& args) {
  LocalOptions o;
  FlagSet flags(
      "fluxion local",
      "Starts a router, prefill and decode nodes as separate processes on this machine "
      "(real gRPC, real UCX over loopback), waits until they are healthy, replays a short "
      "bundled Mooncake trace scaled to the machine, prints the report and shuts "
      "everything down (also on Ctrl-C). docs/CLUSTER.md.");
  RegisterFlags(flags, o);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::Status s = CheckOptions(o); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  if (o.out_dir.empty()) o.out_dir = absl::StrCat("/tmp/fluxion-local-", std::time(nullptr));
  const std::string logs = o.out_dir + "/logs";
  if (std::system(absl::StrCat("mkdir -p '", logs, "'").c_str()) != 0) {
    std::cerr << "error: cannot create " << logs << "\n";
    return 1;
  }
  auto loaded = LoadMooncakeTrace(o.trace);
  if (!loaded.ok()) {
    std::cerr << "error: " << loaded.status().message() << "\n";
    return 1;
  }
  RunDescription run;
  auto schedule = ApplyTransform(*loaded, o.transform, &run.transform);
  if (!schedule.ok() || schedule->requests.empty()) {
    std::cerr << "error: "
              << (schedule.ok() ? "the schedule is empty" : schedule.status().message()) << "\n";
    return 2;
  }
  return RunLocal(o, logs, *schedule, std::move(run), args);
}

}  // namespace fluxion::cluster
