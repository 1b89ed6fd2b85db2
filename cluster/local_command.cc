#include "cluster/local_command.h"

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <functional>
#include <iostream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cluster/backends.h"
#include "cluster/child_process.h"
#include "cluster/openai_client.h"
#include "cluster/replay_run.h"
#include "cluster/replayer.h"
#include "cluster/trace.h"
#include "proto/prefill_seal.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "grpcpp/grpcpp.h"

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
        return absl::DeadlineExceededError(absl::StrCat(
            children[i]->name(), " did not start serving within ", absl::FormatDuration(timeout),
            " (log: ", children[i]->log_path(), ")"));
      }
    }
  }
  return ports;
}

// One chat request through the HTTP API, to show text in and text out end to end. Informational: a
// failure is printed, not fatal (the replay above is the run's result).
void ShowOneAnswer(int http_port, const std::string& model_dir) {
  std::string name = model_dir;
  while (name.size() > 1 && name.back() == '/') name.pop_back();
  name = name.substr(name.rfind('/') + 1);
  const std::string question = "The secret key is 7391. What is the secret key?";
  auto answer = openai::AskOnce(http_port, name, question, /*chat=*/true, 24, absl::Seconds(60));
  std::cout << "one chat request through the HTTP API (POST /v1/chat/completions, greedy):\n"
            << "  user: " << question << "\n  assistant: "
            << (answer.ok() ? *answer : absl::StrCat("(failed: ", answer.status().message(), ")"))
            << "\n";
}

}  // namespace

int RunLocalCommand(const std::vector<std::string>& args) {
  const std::string root = RepoRoot();
  std::string model = root + "/models/fluxion-tiny-retrieval";
  std::string trace = root + "/cluster/traces/mooncake_conversation_30s.jsonl";
  std::string out_dir, json_path, policy, ucx_tls = "tcp", plot_format = "png";
  int64_t decode_nodes = 1, prefill_nodes = 1, cpu_threads = 1, kv_pages = 16384;
  int64_t vocab_size = 256;
  double startup_timeout_s = 120, timeout_s = 120;
  TraceTransform transform;
  transform.max_requests = 24;
  transform.time_scale = 4;
  transform.length_scale = 1.0 / 32;
  transform.max_input_tokens = 1024;
  transform.max_output_tokens = 32;
  Slo slo{5000, 500, 0};
  FlagSet flags("fluxion local",
                "Starts a router, prefill and decode nodes as separate processes on this machine "
                "(real gRPC, real UCX over loopback), waits until they are healthy, replays a short "
                "bundled Mooncake trace scaled to the machine, prints the report and shuts "
                "everything down (also on Ctrl-C). docs/CLUSTER.md.");
  flags.String("model", &model, "model directory for prefill and decode nodes");
  flags.String("trace", &trace, "Mooncake JSONL trace to replay");
  flags.Int("decode-nodes", &decode_nodes, "decode processes");
  flags.Int("prefill-nodes", &prefill_nodes, "prefill processes");
  // 1 by default, not each node's own default (the CPUs minus one): the nodes and the router share
  // this machine, and two nodes each taking all but one core would fight over them.
  flags.Int("cpu-threads", &cpu_threads,
            "--cpu-threads of each prefill/decode process (its one CPU pool); 0 = each node's "
            "own default (the CPUs it may use minus one)");
  flags.Int("kv-pages", &kv_pages, "KV pages per decode node");
  flags.String("ucx-tls", &ucx_tls, "UCX transports between the nodes: tcp (over lo) or sm");
  flags.String("policy", &policy, "sparse attention policy (empty: the decode nodes' default)");
  std::string decode_device = "cpu", prefill_device = "cpu";
  flags.String("decode-device", &decode_device,
               "--device of each decode node: cpu, or cuda (the hybrid CPU-GPU step)");
  flags.String("prefill-device", &prefill_device,
               "--device of each prefill node: cpu, or cuda (the GPU prefill)");
  flags.Int("vocab-size", &vocab_size,
            "prompt token ids are drawn from [1, vocab-size) (256: the byte-level tiny model)");
  flags.Int("max-requests", &transform.max_requests, "replay the first N requests of the trace");
  flags.Double("sample", &transform.sample_fraction, "keep each request with this probability");
  flags.Double("time-scale", &transform.time_scale, "multiply arrival times (4 = 4x slower)");
  flags.Double("length-scale", &transform.length_scale,
               "multiply input/output lengths (and the 512-token block)");
  flags.Int("max-input-tokens", &transform.max_input_tokens, "cap prompt lengths");
  flags.Int("max-output-tokens", &transform.max_output_tokens, "cap output lengths");
  flags.Double("slo-ttft-ms", &slo.ttft_ms, "goodput objective on TTFT (0 = none)");
  flags.Double("slo-tpot-ms", &slo.tpot_ms, "goodput objective on TPOT (0 = none)");
  flags.Double("timeout-s", &timeout_s, "per-request time budget");
  flags.Double("startup-timeout-s", &startup_timeout_s, "how long to wait for the nodes");
  flags.String("out-dir", &out_dir,
               "results and logs (default /tmp/fluxion-local-<time>): summary.json, CSV, plots/, "
               "logs/");
  flags.String("json", &json_path, "also write the summary JSON here");
  flags.String("plot-format", &plot_format, "png or svg");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (cpu_threads < 0 || cpu_threads > kMaxCpuThreads) {
    std::cerr << "error: --cpu-threads must be in [0, " << kMaxCpuThreads << "], got "
              << cpu_threads << "\n";
    return 2;
  }
  if (decode_nodes < 1 || prefill_nodes < 1) {
    std::cerr << "error: need at least one decode and one prefill node\n";
    return 2;
  }
  if (ucx_tls != "tcp" && ucx_tls != "sm") {
    std::cerr << "error: --ucx-tls must be tcp or sm\n";
    return 2;
  }
  // Checked here, before the cast to the replayer's 32-bit field (4294967298 would become 2).
  if (vocab_size < 2 || vocab_size > (int64_t{1} << 24)) {
    std::cerr << "error: --vocab-size must be in [2, 16777216], got " << vocab_size << "\n";
    return 2;
  }
  if (out_dir.empty()) out_dir = absl::StrCat("/tmp/fluxion-local-", std::time(nullptr));
  const std::string logs = out_dir + "/logs";
  if (std::system(absl::StrCat("mkdir -p '", logs, "'").c_str()) != 0) {
    std::cerr << "error: cannot create " << logs << "\n";
    return 1;
  }
  auto loaded = LoadMooncakeTrace(trace);
  if (!loaded.ok()) {
    std::cerr << "error: " << loaded.status().message() << "\n";
    return 1;
  }
  RunDescription run;
  auto schedule = ApplyTransform(*loaded, transform, &run.transform);
  if (!schedule.ok() || schedule->requests.empty()) {
    std::cerr << "error: "
              << (schedule.ok() ? "the schedule is empty" : schedule.status().message()) << "\n";
    return 2;
  }

  InterruptScope interrupt;  // Ctrl-C from here on: stop replaying, then shut the nodes down
  const std::string self = SelfPath();
  std::vector<std::string> ucx = {"--ucx-tls", ucx_tls == "tcp" ? "tcp" : "sm,self"};
  if (ucx_tls == "tcp") {
    ucx.insert(ucx.end(), {"--ucx-net-devices", "lo"});
  } else {
    ucx.push_back("--noucx-peer-error-handling");  // UCX 1.13's shared memory cannot do it
  }
  // Children are stopped in reverse start order by the vector's destructor or explicitly below.
  std::vector<std::unique_ptr<ChildProcess>> children;
  auto shutdown = [&] {
    for (auto it = children.rbegin(); it != children.rend(); ++it) {
      std::string how = (*it)->Stop(absl::Seconds(10));
      std::cout << "  " << (*it)->name() << " (pid " << (*it)->pid() << "): " << how << "\n";
    }
    children.clear();
  };
  auto start = [&](const std::string& name, const std::string& command,
                   std::vector<std::string> extra) -> absl::Status {
    std::vector<std::string> argv = {self, command};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto child = ChildProcess::Start(name, argv, absl::StrCat(logs, "/", name, ".log"));
    if (!child.ok()) return child.status();
    children.push_back(std::move(*child));
    return absl::OkStatus();
  };
  auto fail = [&](const absl::Status& s) {
    std::cerr << "error: " << s.message() << "\nshutting down:\n";
    shutdown();
    return s.code() == absl::StatusCode::kCancelled ? 130 : 1;
  };
  const absl::Duration startup = absl::Seconds(startup_timeout_s);

  // One fresh secret per run, shared by every node (sealed prefill requests, docs/SECURITY.md),
  // in the logs folder with mode 0600.
  const std::string transfer_secret = absl::StrCat(logs, "/transfer.secret");
  if (absl::Status s = proto::WriteNewTransferSecret(transfer_secret); !s.ok()) return fail(s);
  std::cout << "fluxion local: starting " << prefill_nodes << " prefill, " << decode_nodes
            << " decode node(s) and a router; logs in " << logs << std::endl;
  std::vector<std::string> prefill_addresses, decode_addresses;
  // Every node's Prometheus endpoint, "name http://127.0.0.1:port/metrics", printed once ready.
  std::vector<std::string> metrics_urls;
  // Starts `count` nodes of `command` (gRPC and /metrics on free loopback ports, each written to
  // a port file) and waits until all serve; appends their gRPC addresses.
  auto start_nodes = [&](const std::string& command, int64_t count,
                         const std::function<std::vector<std::string>(int64_t)>& node_args,
                         std::vector<std::string>* addresses) -> absl::Status {
    std::vector<ChildProcess*> started;
    std::vector<std::string> port_files, names;
    for (int64_t i = 0; i < count; ++i) {
      std::string name = absl::StrCat(command, "-", i);
      std::string port_file = absl::StrCat(logs, "/", name, ".port");
      std::string metrics_file = absl::StrCat(logs, "/", name, ".metrics-port");
      std::vector<std::string> a = {"--model", model, "--listen", "127.0.0.1:0", "--port-file",
                                    port_file, "--metrics-listen", "127.0.0.1:0",
                                    "--metrics-port-file", metrics_file, "--cpu-threads",
                                    std::to_string(cpu_threads), "--transfer-secret-file",
                                    transfer_secret};
      std::vector<std::string> more = node_args(i);
      a.insert(a.end(), more.begin(), more.end());
      a.insert(a.end(), ucx.begin(), ucx.end());
      if (absl::Status s = start(name, command, a); !s.ok()) return s;
      started.insert(started.end(), {children.back().get(), children.back().get()});
      port_files.insert(port_files.end(), {port_file, metrics_file});
      names.push_back(name);
    }
    auto ports = WaitForPorts(started, port_files, startup);
    if (!ports.ok()) return ports.status();
    for (size_t i = 0; i < names.size(); ++i) {
      addresses->push_back(absl::StrCat("127.0.0.1:", (*ports)[2 * i]));
      metrics_urls.push_back(
          absl::StrCat(names[i], " http://127.0.0.1:", (*ports)[2 * i + 1], "/metrics"));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = start_nodes(
          "prefill", prefill_nodes,
          [&](int64_t) { return std::vector<std::string>{"--device", prefill_device}; },
          &prefill_addresses);
      !s.ok()) {
    return fail(s);
  }
  if (absl::Status s = start_nodes(
          "decode", decode_nodes,
          [&](int64_t i) {
            // Every decode node trusts every prefill node (the router names any of them); the
            // list is rotated so that the nodes' own defaults start on different ones.
            std::vector<std::string> trusted;
            for (size_t k = 0; k < prefill_addresses.size(); ++k) {
              trusted.push_back(prefill_addresses[(i + k) % prefill_addresses.size()]);
            }
            return std::vector<std::string>{"--kv-pages", std::to_string(kv_pages),
                                            "--prefill-address", absl::StrJoin(trusted, ","),
                                            "--device", decode_device};
          },
          &decode_addresses);
      !s.ok()) {
    return fail(s);
  }
  std::string router_address;
  int metrics_port = 0, http_port = 0;
  {
    const std::string port_file = logs + "/router.port", metrics_file = logs + "/router.metrics-port";
    const std::string http_file = logs + "/router.http-port";
    if (absl::Status s = start("router", "router",
                               {"--listen", "127.0.0.1:0", "--port-file", port_file,
                                "--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                                metrics_file, "--decode", absl::StrJoin(decode_addresses, ","),
                                "--prefill", absl::StrJoin(prefill_addresses, ","),
                                "--http-listen", "127.0.0.1:0", "--http-port-file", http_file,
                                "--model-dir", model});
        !s.ok()) {
      return fail(s);
    }
    ChildProcess* router = children.back().get();
    auto ports = WaitForPorts({router, router, router}, {http_file, port_file, metrics_file},
                              startup);
    if (!ports.ok()) return fail(ports.status());
    http_port = (*ports)[0];
    router_address = absl::StrCat("127.0.0.1:", (*ports)[1]);
    metrics_port = (*ports)[2];
    // Ready when the router itself sees a healthy decode node.
    auto channel = serving::CreateChannel(router_address, serving::ChannelConfig());
    const absl::Time deadline = absl::Now() + startup;
    while (!HealthServing(channel, "fluxion.v1.DecodeService", absl::Milliseconds(500))) {
      if (InterruptScope::interrupted()) return fail(absl::CancelledError("interrupted"));
      if (!router->Running()) {
        return fail(absl::UnavailableError("the router exited; see " + router->log_path()));
      }
      if (absl::Now() > deadline) {
        return fail(absl::DeadlineExceededError(
            "the router found no healthy decode node; see the logs in " + logs));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  metrics_urls.insert(metrics_urls.begin(),
                      absl::StrCat("router http://127.0.0.1:", metrics_port, "/metrics"));
  std::cout << "cluster ready: router " << router_address << ", prefill "
            << absl::StrJoin(prefill_addresses, ",") << ", decode "
            << absl::StrJoin(decode_addresses, ",") << "\n"
            << "OpenAI-compatible HTTP API: http://127.0.0.1:" << http_port << "/v1\n"
            << "metrics (Prometheus text, while the cluster runs):\n  "
            << absl::StrJoin(metrics_urls, "\n  ") << "\n"
            << "replaying " << schedule->requests.size() << " requests of " << trace << "\n"
            << std::flush;

  ReplayOptions options;
  options.target = router_address;
  options.timeout_s = timeout_s;
  options.sparse_policy = policy;
  options.vocab_size = static_cast<uint32_t>(vocab_size);
  options.request_id_prefix = absl::StrCat("local-", std::time(nullptr));
  run.config["target"] = router_address;
  run.config["source"] = absl::StrCat("Mooncake trace ", trace);
  run.config["mode"] = "timed arrivals";
  run.config["transforms"] = DescribeTransform(transform, schedule->block_tokens);
  run.config["cluster"] = absl::StrCat(prefill_nodes, " prefill + ", decode_nodes,
                                       " decode + router, UCX ", ucx_tls, ", ", cpu_threads,
                                       " thread(s) per node");
  run.config["policy"] = policy.empty() ? "decode default" : policy;
  run.config["command"] = absl::StrCat("fluxion local ", absl::StrJoin(args, " "));
  Replayer replayer(options);
  InterruptScope::SetReplayer(&replayer);
  auto records = replayer.Run(*schedule);
  InterruptScope::SetReplayer(nullptr);
  if (!records.ok()) return fail(records.status());

  ReportOutputs outputs;
  outputs.out_dir = out_dir;
  outputs.json_path = json_path;
  outputs.plot_format = plot_format;
  std::cout << "cluster: " << run.config["cluster"].get<std::string>() << "\n";
  ReportResult result = ReportRun(*records, run, slo, outputs);
  ShowOneAnswer(http_port, model);
  std::cout << "logs: " << logs << "/\nshutting down:\n";
  shutdown();
  if (InterruptScope::interrupted()) return 130;
  return (result.stats.failed > 0 || result.write_failed) ? 1 : 0;
}

}  // namespace fluxion::cluster
