#include "cluster/local_command.h"

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <functional>
#include <iostream>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cluster/backends.h"
#include "cluster/child_process.h"
#include "cluster/openai_client.h"
#include "cluster/replay_run.h"
#include "cluster/replayer.h"
#include "cluster/trace.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "proto/prefill_seal.h"

namespace fluxion::cluster {
namespace {

std::string SelfPath() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string("fluxion");
}

bool IsDir(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The checkout the binary belongs to, for the bundled model and trace: FLUXION_SOURCE_DIR, else
// the parent of the binary's folder (build/fluxion), else the working directory.
std::string RepoRoot() {
  if (const char* env = std::getenv("FLUXION_SOURCE_DIR"); env != nullptr && *env) return env;
  std::string self = SelfPath();
  std::string dir = self.substr(0, self.rfind('/'));
  std::string parent = dir.substr(0, dir.rfind('/'));
  if (IsDir(parent + "/models") && IsDir(parent + "/cluster")) return parent;
  return ".";
}

// Waits for every child's port file, or fails on the first that exits, times out, or Ctrl-C.
absl::StatusOr<std::vector<int>> WaitForPorts(std::vector<ChildProcess*> children,
                                              const std::vector<std::string>& port_files,
                                              absl::Duration timeout) {
  std::vector<int> ports(children.size(), 0);
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t i = 0; i < children.size(); ++i) {
    while (true) {
      if (InterruptScope::interrupted()) return absl::CancelledError("interrupted");
      auto port = children[i]->WaitForPortFile(port_files[i], absl::Milliseconds(200));
      if (port.ok()) {
        ports[i] = *port;
        break;
      }
      if (port.status().code() != absl::StatusCode::kDeadlineExceeded) return port.status();
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(children[i]->name(), " did not start serving within ",
                         absl::FormatDuration(timeout), " (log: ", children[i]->log_path(), ")"));
      }
    }
  }
  return ports;
}

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
  std::string name = model_dir;
  while (name.size() > 1 && name.back() == '/') name.pop_back();
  name = name.substr(name.rfind('/') + 1);
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
  std::string model, trace, out_dir, json_path, policy;
  std::string ucx_tls = "tcp", plot_format = "png";
  std::string decode_device = "cpu", prefill_device = "cpu";
  int64_t decode_nodes = 1, prefill_nodes = 1, kv_pages = 16384, vocab_size = 256;
  // 1 by default, not each node's own default (the CPUs minus one): the nodes and the router share
  // this machine, and two nodes each taking all but one core would fight over them.
  int64_t cpu_threads = 1;
  double startup_timeout_s = 120, timeout_s = 120;
  TraceTransform transform;
  Slo slo{5000, 500, 0};

  LocalOptions() {
    const std::string root = RepoRoot();
    model = root + "/models/fluxion-tiny-retrieval";
    trace = root + "/cluster/traces/mooncake_conversation_30s.jsonl";
    transform.max_requests = 24;
    transform.time_scale = 4;
    transform.length_scale = 1.0 / 32;
    transform.max_input_tokens = 1024;
    transform.max_output_tokens = 32;
  }
};

void RegisterFlags(FlagSet& flags, LocalOptions& o) {
  flags.String("model", &o.model, "model directory for prefill and decode nodes");
  flags.String("trace", &o.trace, "Mooncake JSONL trace to replay");
  flags.Int("decode-nodes", &o.decode_nodes, "decode processes");
  flags.Int("prefill-nodes", &o.prefill_nodes, "prefill processes");
  flags.Int("cpu-threads", &o.cpu_threads,
            "--cpu-threads of each prefill/decode process (its one CPU pool); 0 = each node's "
            "own default (the CPUs it may use minus one)");
  flags.Int("kv-pages", &o.kv_pages, "KV pages per decode node");
  flags.String("ucx-tls", &o.ucx_tls, "UCX transports between the nodes: tcp (over lo) or sm");
  flags.String("policy", &o.policy, "sparse attention policy (empty: the decode nodes' default)");
  flags.String("decode-device", &o.decode_device,
               "--device of each decode node: cpu, or cuda (the hybrid CPU-GPU step)");
  flags.String("prefill-device", &o.prefill_device,
               "--device of each prefill node: cpu, or cuda (the GPU prefill)");
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
  flags.Double("startup-timeout-s", &o.startup_timeout_s, "how long to wait for the nodes");
  flags.String("out-dir", &o.out_dir,
               "results and logs (default /tmp/fluxion-local-<time>): summary.json, CSV, plots/, "
               "logs/");
  flags.String("json", &o.json_path, "also write the summary JSON here");
  flags.String("plot-format", &o.plot_format, "png or svg");
}

// After parsing: every check. InvalidArgument (a usage error) names the flag.
absl::Status CheckOptions(const LocalOptions& o) {
  if (o.cpu_threads < 0 || o.cpu_threads > kMaxCpuThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu-threads must be in [0, ", kMaxCpuThreads, "], got ", o.cpu_threads));
  }
  if (o.decode_nodes < 1 || o.prefill_nodes < 1) {
    return absl::InvalidArgumentError("need at least one decode and one prefill node");
  }
  if (o.ucx_tls != "tcp" && o.ucx_tls != "sm") {
    return absl::InvalidArgumentError("--ucx-tls must be tcp or sm");
  }
  // Checked here, before the cast to the replayer's 32-bit field (4294967298 would become 2).
  if (o.vocab_size < 2 || o.vocab_size > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab-size must be in [2, 16777216], got ", o.vocab_size));
  }
  return absl::OkStatus();
}

// The processes of one local cluster: started in order (prefill nodes, decode nodes, router),
// stopped in reverse by Shutdown() or the destructor. Thread-compatible.
class LocalCluster {
 public:
  LocalCluster(const LocalOptions& o, std::string logs)
      : o_(o), logs_(std::move(logs)), self_(SelfPath()) {
    ucx_ = {"--ucx-tls", o.ucx_tls == "tcp" ? "tcp" : "sm,self"};
    if (o.ucx_tls == "tcp") {
      ucx_.insert(ucx_.end(), {"--ucx-net-devices", "lo"});
    } else {
      ucx_.push_back("--noucx-peer-error-handling");  // UCX 1.13's shared memory cannot do it
    }
  }

  // Writes the run's transfer secret, starts every node and the router, and waits until the
  // router sees a healthy decode node. Cancelled after Ctrl-C.
  absl::Status Start() {
    // One fresh secret per run, shared by every node (sealed prefill requests,
    // docs/SECURITY.md), in the logs folder with mode 0600.
    transfer_secret_ = absl::StrCat(logs_, "/transfer.secret");
    FLUXION_RETURN_IF_ERROR(proto::WriteNewTransferSecret(transfer_secret_));
    std::cout << "fluxion local: starting " << o_.prefill_nodes << " prefill, " << o_.decode_nodes
              << " decode node(s) and a router; logs in " << logs_ << std::endl;
    FLUXION_RETURN_IF_ERROR(StartNodes(
        "prefill", o_.prefill_nodes,
        [&](int64_t) {
          return std::vector<std::string>{"--device", o_.prefill_device};
        },
        &prefill_addresses_));
    FLUXION_RETURN_IF_ERROR(StartNodes(
        "decode", o_.decode_nodes, [&](int64_t i) { return DecodeNodeArgs(i); },
        &decode_addresses_));
    return StartRouter();
  }

  ~LocalCluster() { Shutdown(); }

  // Stops the children in reverse start order, printing how each ended.
  void Shutdown() {
    for (auto it = children_.rbegin(); it != children_.rend(); ++it) {
      std::string how = (*it)->Stop(absl::Seconds(10));
      std::cout << "  " << (*it)->name() << " (pid " << (*it)->pid() << "): " << how << "\n";
    }
    children_.clear();
  }

  void PrintReady(size_t requests) const {
    std::cout << "cluster ready: router " << router_address_ << ", prefill "
              << absl::StrJoin(prefill_addresses_, ",") << ", decode "
              << absl::StrJoin(decode_addresses_, ",") << "\n"
              << "OpenAI-compatible HTTP API: http://127.0.0.1:" << http_port_ << "/v1\n"
              << "metrics (Prometheus text, while the cluster runs):\n  "
              << absl::StrJoin(metrics_urls_, "\n  ") << "\n"
              << "replaying " << requests << " requests of " << o_.trace << "\n"
              << std::flush;
  }

  const std::string& router_address() const { return router_address_; }
  int http_port() const { return http_port_; }

 private:
  absl::Status StartChild(const std::string& name, const std::string& command,
                          const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {self_, command};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto child = ChildProcess::Start(name, argv, absl::StrCat(logs_, "/", name, ".log"));
    if (!child.ok()) return child.status();
    children_.push_back(std::move(*child));
    return absl::OkStatus();
  }

  // Every decode node trusts every prefill node (the router names any of them); the list is
  // rotated so that the nodes' own defaults start on different ones.
  std::vector<std::string> DecodeNodeArgs(int64_t i) const {
    std::vector<std::string> trusted;
    for (size_t k = 0; k < prefill_addresses_.size(); ++k) {
      trusted.push_back(prefill_addresses_[(i + k) % prefill_addresses_.size()]);
    }
    return {"--kv-pages",        std::to_string(o_.kv_pages),
            "--prefill-address", absl::StrJoin(trusted, ","),
            "--device",          o_.decode_device};
  }

  // Starts `count` nodes of `command` (gRPC and /metrics on free loopback ports, each written to
  // a port file) and waits until all serve; appends their gRPC addresses and /metrics URLs.
  absl::Status StartNodes(const std::string& command, int64_t count,
                          const std::function<std::vector<std::string>(int64_t)>& node_args,
                          std::vector<std::string>* addresses) {
    std::vector<ChildProcess*> started;
    std::vector<std::string> port_files, names;
    for (int64_t i = 0; i < count; ++i) {
      std::string name = absl::StrCat(command, "-", i);
      std::string port_file = absl::StrCat(logs_, "/", name, ".port");
      std::string metrics_file = absl::StrCat(logs_, "/", name, ".metrics-port");
      std::vector<std::string> a = {"--model",
                                    o_.model,
                                    "--listen",
                                    "127.0.0.1:0",
                                    "--port-file",
                                    port_file,
                                    "--metrics-listen",
                                    "127.0.0.1:0",
                                    "--metrics-port-file",
                                    metrics_file,
                                    "--cpu-threads",
                                    std::to_string(o_.cpu_threads),
                                    "--transfer-secret-file",
                                    transfer_secret_};
      std::vector<std::string> more = node_args(i);
      a.insert(a.end(), more.begin(), more.end());
      a.insert(a.end(), ucx_.begin(), ucx_.end());
      FLUXION_RETURN_IF_ERROR(StartChild(name, command, a));
      started.insert(started.end(), {children_.back().get(), children_.back().get()});
      port_files.insert(port_files.end(), {port_file, metrics_file});
      names.push_back(name);
    }
    auto ports = WaitForPorts(started, port_files, absl::Seconds(o_.startup_timeout_s));
    if (!ports.ok()) return ports.status();
    for (size_t i = 0; i < names.size(); ++i) {
      addresses->push_back(absl::StrCat("127.0.0.1:", (*ports)[2 * i]));
      metrics_urls_.push_back(
          absl::StrCat(names[i], " http://127.0.0.1:", (*ports)[2 * i + 1], "/metrics"));
    }
    return absl::OkStatus();
  }

  // The router in front of every node, with the HTTP API; ready when it sees a healthy decode
  // node.
  absl::Status StartRouter() {
    const std::string port_file = logs_ + "/router.port";
    const std::string metrics_file = logs_ + "/router.metrics-port";
    const std::string http_file = logs_ + "/router.http-port";
    FLUXION_RETURN_IF_ERROR(StartChild(
        "router", "router",
        {"--listen", "127.0.0.1:0", "--port-file", port_file, "--metrics-listen", "127.0.0.1:0",
         "--metrics-port-file", metrics_file, "--decode", absl::StrJoin(decode_addresses_, ","),
         "--prefill", absl::StrJoin(prefill_addresses_, ","), "--http-listen", "127.0.0.1:0",
         "--http-port-file", http_file, "--model-dir", o_.model}));
    ChildProcess* router = children_.back().get();
    const absl::Duration startup = absl::Seconds(o_.startup_timeout_s);
    auto ports =
        WaitForPorts({router, router, router}, {http_file, port_file, metrics_file}, startup);
    if (!ports.ok()) return ports.status();
    http_port_ = (*ports)[0];
    router_address_ = absl::StrCat("127.0.0.1:", (*ports)[1]);
    metrics_urls_.insert(metrics_urls_.begin(),
                         absl::StrCat("router http://127.0.0.1:", (*ports)[2], "/metrics"));
    auto channel = serving::CreateChannel(router_address_, serving::ChannelConfig());
    const absl::Time deadline = absl::Now() + startup;
    while (!HealthServing(channel, "fluxion.v1.DecodeService", absl::Milliseconds(500))) {
      if (InterruptScope::interrupted()) return absl::CancelledError("interrupted");
      if (!router->Running()) {
        return absl::UnavailableError("the router exited; see " + router->log_path());
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            "the router found no healthy decode node; see the logs in " + logs_);
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::OkStatus();
  }

  const LocalOptions& o_;
  const std::string logs_;
  const std::string self_;
  std::vector<std::string> ucx_;  // the nodes' UCX flags
  std::string transfer_secret_;
  std::vector<std::unique_ptr<ChildProcess>> children_;
  std::vector<std::string> prefill_addresses_, decode_addresses_;
  // Every node's Prometheus endpoint, "name http://127.0.0.1:port/metrics", printed once ready.
  std::vector<std::string> metrics_urls_;
  std::string router_address_;
  int http_port_ = 0;
};

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
  run->config["cluster"] =
      absl::StrCat(o.prefill_nodes, " prefill + ", o.decode_nodes, " decode + router, UCX ",
                   o.ucx_tls, ", ", o.cpu_threads, " thread(s) per node");
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
  LocalCluster cluster(o, logs);
  auto fail = [&](const absl::Status& s) {
    std::cerr << "error: " << s.message() << "\nshutting down:\n";
    cluster.Shutdown();
    return s.code() == absl::StatusCode::kCancelled ? 130 : 1;
  };
  if (absl::Status s = cluster.Start(); !s.ok()) return fail(s);
  cluster.PrintReady(schedule.requests.size());
  auto records = Replay(o, cluster, schedule, args, &run);
  if (!records.ok()) return fail(records.status());
  ReportOutputs outputs;
  outputs.out_dir = o.out_dir;
  outputs.json_path = o.json_path;
  outputs.plot_format = o.plot_format;
  std::cout << "cluster: " << run.config["cluster"].get<std::string>() << "\n";
  ReportResult result = ReportRun(*records, run, o.slo, outputs);
  ShowOneAnswer(cluster.http_port(), o.model);
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
