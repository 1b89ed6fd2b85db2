#include "cluster/serve_command.h"

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cluster/local_cluster.h"
#include "cluster/openai_serving.h"
#include "cluster/replay_run.h"
#include "common/cpu_threads.h"
#include "common/flag_set.h"

namespace fluxion::cluster {
namespace {

// How often the supervisor looks for a child that died.
constexpr absl::Duration kSupervisePeriod = absl::Milliseconds(200);
// cpu_threads before parsing: "not given", shared out once the node counts are known.
constexpr int64_t kShareCpus = -1;

struct ServeOptions {
  LocalClusterOptions cluster;
  // Loopback by default: the API serves whoever reaches the port, so exposing it is a choice
  // (--host 0.0.0.0), best made with --api-key.
  std::string host = "127.0.0.1";
  int64_t port = 8000;  // vLLM's default, so clients' base URLs carry over
  std::string served_model_name, api_key, policy, log_dir, chat_template;
  int64_t max_model_len = 0;
  double budget = 0;

  ServeOptions() {
    cluster.model = RepoRoot() + "/models/fluxion-tiny-retrieval";
    cluster.cpu_threads = kShareCpus;
  }
};

void RegisterFlags(FlagSet& flags, ServeOptions& o) {
  RegisterLocalClusterFlags(flags, &o.cluster);
  flags.String("host", &o.host, "address the OpenAI HTTP API listens on (0.0.0.0: every one)");
  flags.Int("port", &o.port, "port of the OpenAI HTTP API (0 picks a free one, printed)");
  flags.String("served-model-name", &o.served_model_name,
               "model id clients name (default: the model directory's name)");
  flags.Int("max-model-len", &o.max_model_len,
            "longest context (prompt plus generated tokens) a request may reach, at most the "
            "model's max_position_embeddings (0: that)");
  flags.String("api-key", &o.api_key,
               "key the /v1/ endpoints require as `Authorization: Bearer KEY` (default: "
               "$FLUXION_API_KEY, else none; prefer the environment: flags are visible in ps)");
  flags.String("chat-template", &o.chat_template,
               "a Jinja chat template file instead of the model's tokenizer_config.json one "
               "(docs/CHAT.md)");
  flags.String("policy", &o.policy,
               "sparse attention policy for requests that name none (empty: the decode "
               "node's default, fluxion)");
  flags.Double("budget", &o.budget, "its budget, a fraction of the context (0: the default)");
  flags.String("log-dir", &o.log_dir,
               "each process's log, port files and the run's transfer secret (default "
               "/tmp/fluxion-serve-<time>)");
}

absl::Status CheckOptions(const ServeOptions& o) {
  if (o.port < 0 || o.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--port must be in [0, 65535], got ", o.port));
  }
  if (o.host.empty() || o.host.find_first_of(" /") != std::string::npos) {
    return absl::InvalidArgumentError("--host must be an address or host name");
  }
  if (o.max_model_len < 0) {
    return absl::InvalidArgumentError("--max-model-len must be >= 0 (0: the model's)");
  }
  if (o.budget < 0 || o.budget > 1) {
    return absl::InvalidArgumentError("--budget must be in [0, 1] (0: the default)");
  }
  return CheckLocalClusterOptions(o.cluster);
}

// The flags each child gets from the serve flags. The key travels in the environment the children
// inherit, not on a command line every user of the machine can read.
void ResolveChildArgs(ServeOptions& o) {
  LocalClusterOptions& c = o.cluster;
  if (c.cpu_threads == kShareCpus) {
    // The CPUs minus one (the router's), shared evenly: two nodes each taking all but one core
    // would fight over them.
    const int64_t nodes = c.prefill_nodes + c.decode_nodes;
    c.cpu_threads = std::max<int64_t>(1, (AvailableCpus() - 1) / nodes);
  }
  if (!o.api_key.empty()) setenv("FLUXION_API_KEY", o.api_key.c_str(), 1);
  const bool bare_ipv6 = o.host.find(':') != std::string::npos && o.host[0] != '[';
  c.http_listen = absl::StrCat(bare_ipv6 ? "[" + o.host + "]" : o.host, ":", o.port);
  if (!o.chat_template.empty()) {
    c.router_args.insert(c.router_args.end(), {"--chat-template", o.chat_template});
  }
  if (!o.served_model_name.empty()) {
    c.router_args.insert(c.router_args.end(), {"--served-model-name", o.served_model_name});
    c.decode_args.insert(c.decode_args.end(), {"--served-model-name", o.served_model_name});
  }
  if (o.max_model_len > 0) {
    const std::string len = std::to_string(o.max_model_len);
    c.router_args.insert(c.router_args.end(), {"--max-model-len", len});
    c.decode_args.insert(c.decode_args.end(), {"--max-model-len", len});
  }
  if (!o.policy.empty()) c.decode_args.insert(c.decode_args.end(), {"--default-policy", o.policy});
  if (o.budget > 0) {
    c.decode_args.insert(c.decode_args.end(), {"--default-budget", absl::StrCat(o.budget)});
  }
}

void PrintServing(const ServeOptions& o, const LocalCluster& cluster, const std::string& logs) {
  const bool keyed = std::getenv("FLUXION_API_KEY") != nullptr;
  std::cout << "serving \"" << ServedModelName(o.served_model_name, o.cluster.model)
            << "\": OpenAI-compatible HTTP API on http://" << o.host << ":" << cluster.http_port()
            << "/v1" << (keyed ? " (bearer key required)" : "") << "\n"
            << "  gRPC (fluxion.v1.DecodeService, vllm.grpc.engine.VllmEngine): "
            << cluster.router_address() << "\n  metrics:\n    "
            << absl::StrJoin(cluster.metrics_urls(), "\n    ") << "\n  logs: " << logs
            << "\nstop with Ctrl-C (or SIGTERM)" << std::endl;
}

// Until SIGINT/SIGTERM: restarts whichever process dies, saying so.
void Supervise(LocalCluster& cluster) {
  while (!InterruptScope::interrupted()) {
    for (const std::string& line : cluster.RestartExited()) std::cout << line << std::endl;
    absl::SleepFor(kSupervisePeriod);
  }
}

}  // namespace

int RunServeCommand(const std::vector<std::string>& args) {
  ServeOptions o;
  FlagSet flags(
      "fluxion serve",
      "Serves a model with the OpenAI-compatible HTTP API until stopped: starts a router, "
      "prefill and decode nodes on this machine as child processes (real gRPC, real UCX over "
      "loopback), prints the API's URL once a decode node is healthy, restarts any process that "
      "dies on the ports it had, and on Ctrl-C or SIGTERM drains and stops them all. "
      "`fluxion serve DIR` is `--model DIR`; without one it serves the bundled tiny model. By "
      "default the nodes share the CPUs minus one evenly (--cpu-threads each). docs/CLUSTER.md.");
  RegisterFlags(flags, o);
  std::vector<std::string> flag_args = args;
  if (!flag_args.empty() && !flag_args[0].empty() && flag_args[0][0] != '-') {
    flag_args.insert(flag_args.begin(), "--model");
  }
  if (int rc = ParseFlagsOrExit(flags, flag_args); rc >= 0) return rc;
  ResolveChildArgs(o);
  if (absl::Status s = CheckOptions(o); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  const std::string logs =
      o.log_dir.empty() ? absl::StrCat("/tmp/fluxion-serve-", std::time(nullptr)) : o.log_dir;
  if (std::system(absl::StrCat("mkdir -p '", logs, "'").c_str()) != 0) {
    std::cerr << "error: cannot create " << logs << "\n";
    return 1;
  }
  InterruptScope interrupt;
  LocalCluster cluster(o.cluster, logs);
  if (absl::Status s = cluster.Start(); !s.ok()) {
    std::cerr << "error: " << s.message() << "\nshutting down:\n";
    cluster.Shutdown();
    return s.code() == absl::StatusCode::kCancelled ? 130 : 1;
  }
  PrintServing(o, cluster, logs);
  Supervise(cluster);
  std::cout << "stopping:" << std::endl;
  cluster.Shutdown();
  return 0;
}

}  // namespace fluxion::cluster
