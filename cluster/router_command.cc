#include "cluster/router_command.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <ctime>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cluster/backends.h"
#include "cluster/openai_serving.h"
#include "cluster/router_service.h"
#include "cluster/vllm_engine_command.h"
#include "common/flag_set.h"
#include "common/grpc_security.h"
#include "common/metrics_http.h"
#include "common/server_main.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "model/tokenizer.h"

namespace fluxion::cluster {

int RunRouterCommand(const std::vector<std::string>& args) {
  std::string listen = serving::LoopbackAddress(7000), metrics_listen = "127.0.0.1:9100";
  std::string node_name;
  std::string port_file, metrics_port_file;
  std::vector<std::string> decode, prefill, decode_dns, prefill_dns;
  int64_t poll_ms = 200, max_attempts = 3, deadline_grace_ms = 500, drain_timeout_ms = 30000;
  double shed_kv_usage = 0.95;
  FlagSet flags("fluxion router",
                "Serves fluxion.v1.DecodeService and forwards each request to a prefill/decode "
                "pair picked by load, with health checks, retries before the first token and load "
                "shedding (docs/CLUSTER.md).");
  flags.String("listen", &listen,
               "gRPC address to serve clients on (0.0.0.0:7000: every interface)");
  flags.String("metrics-listen", &metrics_listen,
               "HTTP address for Prometheus /metrics (empty: no endpoint)");
  flags.StringList("decode", &decode, "decode nodes, host:port, comma-separated");
  flags.StringList("prefill", &prefill, "prefill nodes, host:port, comma-separated");
  flags.StringList("decode-dns", &decode_dns,
                   "DNS names of decode nodes, name:port (every A record, e.g. a headless service)");
  flags.StringList("prefill-dns", &prefill_dns, "DNS names of prefill nodes, name:port");
  flags.Int("poll-ms", &poll_ms, "health check and GetLoad interval");
  int64_t health_failures = HealthHysteresisOptions{}.failures_to_eject;
  int64_t health_successes = HealthHysteresisOptions{}.successes_to_admit;
  flags.Int("health-failures", &health_failures,
            "drop a node after this many health checks in a row got no answer in time (a "
            "NOT_SERVING or draining answer drops it at once)");
  flags.Int("health-successes", &health_successes,
            "take a dropped node back after this many passing health checks in a row (a node "
            "never seen healthy joins on its first)");
  flags.Double("shed-kv-usage", &shed_kv_usage,
               "refuse requests (RESOURCE_EXHAUSTED) when every decode node's KV usage is at or "
               "above this fraction");
  flags.Int("max-attempts", &max_attempts,
            "tries per request, each on another decode node, only before the first token");
  flags.Int("deadline-grace-ms", &deadline_grace_ms,
            "each attempt's gRPC deadline is the request's budget plus this, so the decode "
            "node's own DEADLINE_EXCEEDED message (usage, timing) reaches the client first");
  flags.Int("drain-timeout-ms", &drain_timeout_ms,
            "on SIGTERM: readiness NOT_SERVING (liveness stays SERVING), new requests refused "
            "(UNAVAILABLE; HTTP 503), open ones get this long to finish; then they are aborted "
            "(their streams end with the tokens so far and finish reason abort) and the process "
            "exits within 3 s more");
  flags.String("node-name", &node_name, "name in GetLoad (default: hostname/start time)");
  flags.String("port-file", &port_file, "write the bound gRPC port into this file once serving");
  flags.String("metrics-port-file", &metrics_port_file,
               "write the bound /metrics port into this file once serving");
  // One model directory for both text front ends (each loads its tokenizer from it).
  std::string model_dir;
  flags.String("model-dir", &model_dir,
               "model directory whose tokenizer.json / chat template / config.json the router "
               "reads for text in and out: the OpenAI HTTP API (needed with --http-listen) and "
               "vllm.grpc.engine.VllmEngine text input and GetModelInfo (empty: token ids only)");
  OpenAiFlags openai_flags;
  RegisterOpenAiFlags(flags, &openai_flags);
  VllmEngineFlags vllm_flags;
  serving::ServerTlsOptions tls;
  serving::RegisterServerTlsFlags(flags, &tls);
  serving::ClientTlsOptions backend_tls;
  serving::RegisterClientTlsFlags(flags, "backend-tls", "decode and prefill nodes", &backend_tls);
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (absl::Status valid = serving::ValidateDrainTimeoutMs(drain_timeout_ms); !valid.ok()) {
    std::cerr << "error: " << valid.message() << "\n";
    return 2;
  }
  openai_flags.model_dir = vllm_flags.model_dir = model_dir;
  if (!model_dir.empty()) {
    auto tokenizer = model::LoadTokenizer(model_dir);
    if (!tokenizer.ok()) {
      std::cerr << "error: --model-dir: " << tokenizer.status().message() << "\n";
      return 2;
    }
    openai_flags.tokenizer = vllm_flags.tokenizer = std::move(*tokenizer);
  }
  auto server_credentials = serving::ServerCredentials(tls);
  auto backend_channel = serving::ClientChannelConfig(backend_tls);
  for (const absl::Status& s : {server_credentials.status(), backend_channel.status()}) {
    if (!s.ok()) {
      std::cerr << "error: " << s.message() << "\n";
      return 2;
    }
  }
  if (node_name.empty()) {
    char host[256] = "router";
    gethostname(host, sizeof(host) - 1);
    node_name = absl::StrCat(host, "/", std::time(nullptr));
  }

  // Signals are taken synchronously by the main thread (sigtimedwait), so block them before any
  // thread starts: every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  Backends::Options backend_options;
  backend_options.decode_addresses = decode;
  backend_options.prefill_addresses = prefill;
  backend_options.decode_dns = decode_dns;
  backend_options.prefill_dns = prefill_dns;
  backend_options.poll_interval = absl::Milliseconds(poll_ms);
  backend_options.channel = *backend_channel;
  // Clamped into int only so that the range check (Backends::Create) sees an out-of-range value.
  backend_options.health.failures_to_eject =
      static_cast<int>(std::clamp<int64_t>(health_failures, INT32_MIN, INT32_MAX));
  backend_options.health.successes_to_admit =
      static_cast<int>(std::clamp<int64_t>(health_successes, INT32_MIN, INT32_MAX));
  backend_options.registry = &metrics::Registry::Default();
  auto backends = Backends::Create(backend_options);
  if (!backends.ok()) {
    std::cerr << "error: " << backends.status().message() << "\n";
    return 2;
  }
  RouterOptions router_options;
  router_options.shed_kv_usage = shed_kv_usage;
  router_options.max_attempts = static_cast<int>(max_attempts);
  router_options.node_name = node_name;
  router_options.deadline_grace = absl::Milliseconds(std::max<int64_t>(0, deadline_grace_ms));
  metrics::Registry& registry = metrics::Registry::Default();
  RouterService service(backends->get(), router_options, &registry);
  // Ready while a decode node is healthy and the router is not draining: GET /health, the
  // VllmEngine HealthCheck (the grpc.health names follow the same rule below).
  Backends* backends_ptr = backends->get();
  std::atomic<bool> draining{false};
  auto ready = [backends_ptr, &draining] {
    return !draining.load() && backends_ptr->HealthyCount(Role::kDecode) > 0;
  };
  auto vllm_service = MakeVllmEngineService(vllm_flags, ready);
  if (!vllm_service.ok()) {
    std::cerr << "error: " << vllm_service.status().message() << "\n";
    return 2;
  }

  auto metrics_started = serving::StartMetricsIfRequested(metrics_listen, &registry);
  if (!metrics_started.ok()) {
    std::cerr << "error: " << metrics_started.status().message() << "\n";
    return 1;
  }
  std::unique_ptr<metrics::MetricsHttpServer> metrics_server = std::move(*metrics_started);
  if (metrics_server) metrics_server->SetReadiness(ready);  // /readyz: the same rule
  int port = 0;
  serving::GrpcServerOptions server_options;
  server_options.credentials = *server_credentials;
  server_options.more_services.push_back((*vllm_service)->service());
  auto server_started = serving::StartGrpcServer(listen, &service, &port, server_options);
  if (!server_started.ok()) {
    std::cerr << "error: " << server_started.status().message() << "\n";
    return 1;
  }
  std::unique_ptr<grpc::Server> server = std::move(*server_started);
  (*vllm_service)->Connect(server.get());
  auto* health = server->GetHealthCheckService();
  // The OpenAI HTTP API, a client of this server's own DecodeService (docs/PROTOCOL.md).
  auto openai = StartOpenAiHttp(openai_flags, server.get(), ready);
  if (!openai.ok()) {
    std::cerr << "error: " << openai.status().message() << "\n";
    return 1;
  }
  serving::WritePortFiles(port_file, port, metrics_port_file, metrics_server.get());
  std::cout << "router: serving fluxion.v1.DecodeService on port " << port
            << (metrics_server ? absl::StrCat(", /metrics on port ", metrics_server->port()) : "")
            << "; decode " << absl::StrJoin(decode, ",") << absl::StrJoin(decode_dns, ",")
            << (prefill.empty() && prefill_dns.empty()
                    ? std::string()
                    : absl::StrCat("; prefill ", absl::StrJoin(prefill, ","),
                                   absl::StrJoin(prefill_dns, ",")))
            << std::endl;

  // Readiness follows the decode nodes: NOT_SERVING for the service name while none is healthy
  // (the empty name, liveness, stays SERVING).
  timespec tick{0, 200 * 1000 * 1000};
  bool serving = false;
  health->SetServingStatus("fluxion.v1.DecodeService", false);
  health->SetServingStatus(kVllmEngineServiceName, false);
  while (true) {
    bool now_serving = (*backends)->HealthyCount(Role::kDecode) > 0;
    if (now_serving != serving) {
      health->SetServingStatus("fluxion.v1.DecodeService", now_serving);
      health->SetServingStatus(kVllmEngineServiceName, now_serving);
      std::cout << "router: " << (now_serving ? "ready" : "no healthy decode node, not ready")
                << std::endl;
      serving = now_serving;
    }
    int sig = sigtimedwait(&signals, nullptr, &tick);
    if (sig == SIGINT || sig == SIGTERM) break;
  }
  // Drain (common/server_main.h, DrainPlan): readiness NOT_SERVING while liveness ("") stays
  // SERVING, new calls refused, open ones may finish; then aborted with a reason. The HTTP front
  // end is a client of this server, so its streams are counted, and end, with the gRPC calls they
  // relay.
  draining = true;
  std::cout << "router: draining, " << service.inflight() << " requests open, up to "
            << drain_timeout_ms << " ms" << std::endl;
  serving::DrainPlan drain;
  drain.service_names = {"fluxion.v1.DecodeService", kVllmEngineServiceName};
  drain.start_draining = [&] { service.SetDraining(true); };
  drain.live_requests = [&] { return static_cast<int64_t>(service.inflight()); };
  drain.end_remaining = [&] {
    service.AbortAll(absl::StrCat("router ", node_name,
                                  " shut down: the drain after SIGTERM ran past "
                                  "--drain-timeout-ms (",
                                  drain_timeout_ms, " ms)"));
  };
  drain.timeout = absl::Milliseconds(drain_timeout_ms);
  const int64_t left = serving::DrainAndShutdown(server.get(), drain);
  openai->reset();
  server->Wait();
  std::cout << "router: stopped; " << left << " requests were open at the drain timeout"
            << std::endl;
  return 0;
}

}  // namespace fluxion::cluster
