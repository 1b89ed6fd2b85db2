#include "cluster/router_server.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <ctime>
#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/metrics.h"
#include "common/metrics_names.h"
#include "common/status_macros.h"
#include "model/tokenizer.h"

namespace fluxion::cluster {
namespace {

constexpr char kDecodeServiceName[] = "fluxion.v1.DecodeService";

}  // namespace

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(RouterServerConfig config) {
  FLUXION_RETURN_IF_ERROR(serving::ValidateDrainTimeoutMs(config.drain_timeout_ms));
  std::unique_ptr<RouterServer> router(new RouterServer(std::move(config)));
  RouterServerConfig& c = router->config_;
  VllmEngineFlags vllm_flags;
  c.openai.model_dir = vllm_flags.model_dir = c.model_dir;
  if (!c.model_dir.empty()) {
    vllm_flags.served_model_name = ServedModelName(c.openai.served_model_name, c.model_dir);
    metrics::Registry::Default()
        .AddGauge(metrics::names::kModelInfo,
                  "The served model (vLLM's model_name label), value 1.",
                  {{"model_name", vllm_flags.served_model_name}})
        ->Set(1);
  }
  if (!c.model_dir.empty()) {
    auto tokenizer = model::LoadTokenizer(c.model_dir);
    if (!tokenizer.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--model-dir: ", tokenizer.status().message()));
    }
    c.openai.tokenizer = vllm_flags.tokenizer = std::move(*tokenizer);
  }
  auto server_credentials = serving::ServerCredentials(c.tls);
  if (!server_credentials.ok()) {
    return absl::InvalidArgumentError(server_credentials.status().message());
  }
  c.serve.credentials = *std::move(server_credentials);
  if (c.node_name.empty()) {
    char host[256] = "router";
    gethostname(host, sizeof(host) - 1);
    c.node_name = absl::StrCat(host, "/", std::time(nullptr));
  }
  // Signals are taken synchronously by the main thread (sigtimedwait), so block them before any
  // thread starts: every thread inherits the mask.
  serving::BlockStopSignals();
  FLUXION_RETURN_IF_ERROR(router->StartBackends());
  RouterOptions router_options;
  router_options.shed_kv_usage = c.shed_kv_usage;
  router_options.max_attempts = static_cast<int>(c.max_attempts);
  router_options.node_name = c.node_name;
  router_options.deadline_grace = absl::Milliseconds(std::max<int64_t>(0, c.deadline_grace_ms));
  router->service_ = std::make_unique<RouterService>(router->backends_.get(), router_options,
                                                     &metrics::Registry::Default());
  RouterServer* self = router.get();
  auto vllm = MakeVllmEngineService(vllm_flags, [self] { return self->Ready(); });
  if (!vllm.ok()) return absl::InvalidArgumentError(vllm.status().message());
  router->vllm_ = std::move(*vllm);
  return router;
}

RouterServer::~RouterServer() { Shutdown(); }

absl::Status RouterServer::StartBackends() {
  auto backend_channel = serving::ClientChannelConfig(config_.backend_tls);
  if (!backend_channel.ok()) return absl::InvalidArgumentError(backend_channel.status().message());
  Backends::Options options;
  options.decode_addresses = config_.decode;
  options.prefill_addresses = config_.prefill;
  options.decode_dns = config_.decode_dns;
  options.prefill_dns = config_.prefill_dns;
  options.poll_interval = absl::Milliseconds(config_.poll_ms);
  options.channel = *backend_channel;
  // Clamped into int only so that the range check (Backends::Create) sees an out-of-range value.
  options.health.failures_to_eject =
      static_cast<int>(std::clamp<int64_t>(config_.health_failures, INT32_MIN, INT32_MAX));
  options.health.successes_to_admit =
      static_cast<int>(std::clamp<int64_t>(config_.health_successes, INT32_MIN, INT32_MAX));
  options.registry = &metrics::Registry::Default();
  auto backends = Backends::Create(options);
  if (!backends.ok()) return absl::InvalidArgumentError(backends.status().message());
  backends_ = std::move(*backends);
  return absl::OkStatus();
}

bool RouterServer::Ready() const {
  return !draining_.load() && backends_->HealthyCount(Role::kDecode) > 0;
}

absl::Status RouterServer::Start() {
  FLUXION_ASSIGN_OR_RETURN(
      serve_, serving::GrpcServe::Start(config_.serve, {service_.get(), vllm_->service()},
                                        &metrics::Registry::Default(), [this] { return Ready(); }));
  vllm_->Connect(serve_->server());
  // The OpenAI HTTP API, a client of this server's own DecodeService (docs/PROTOCOL.md).
  auto openai = StartOpenAiHttp(config_.openai, serve_->server(), [this] { return Ready(); });
  if (!openai.ok()) {
    serve_.reset();  // not started: nothing to drain
    return absl::UnavailableError(openai.status().message());
  }
  openai_ = std::move(*openai);
  serve_->WritePortFiles();
  const RouterServerConfig& c = config_;
  const int metrics_port = serve_->metrics_port();
  std::cout << "router: serving fluxion.v1.DecodeService on port " << serve_->port()
            << (metrics_port != 0 ? absl::StrCat(", /metrics on port ", metrics_port) : "")
            << "; decode " << absl::StrJoin(c.decode, ",") << absl::StrJoin(c.decode_dns, ",")
            << (c.prefill.empty() && c.prefill_dns.empty()
                    ? std::string()
                    : absl::StrCat("; prefill ", absl::StrJoin(c.prefill, ","),
                                   absl::StrJoin(c.prefill_dns, ",")))
            << std::endl;
  // Readiness follows the decode nodes: NOT_SERVING for the service names while none is healthy
  // (the empty name, liveness, stays SERVING).
  serving_ = false;
  serve_->SetServing({kDecodeServiceName, kVllmEngineServiceName}, false);
  return absl::OkStatus();
}

void RouterServer::FollowDecodeHealth() {
  const bool now_serving = backends_->HealthyCount(Role::kDecode) > 0;
  if (now_serving == serving_) return;
  serve_->SetServing({kDecodeServiceName, kVllmEngineServiceName}, now_serving);
  std::cout << "router: " << (now_serving ? "ready" : "no healthy decode node, not ready")
            << std::endl;
  serving_ = now_serving;
}

absl::Status RouterServer::Serve() {
  return serving::ServeUntilStopped(*this, [this] { FollowDecodeHealth(); });
}

int64_t RouterServer::Shutdown() {
  if (serve_ == nullptr) return 0;
  // Readiness NOT_SERVING while liveness ("") stays SERVING, new calls refused, open ones may
  // finish; then aborted with a reason. The HTTP front end is a client of this server, so its
  // streams are counted, and end, with the gRPC calls they relay.
  draining_ = true;
  const int64_t drain_timeout_ms = config_.drain_timeout_ms;
  std::cout << "router: draining, " << service_->inflight() << " requests open, up to "
            << drain_timeout_ms << " ms" << std::endl;
  serving::DrainPlan drain;
  drain.service_names = {kDecodeServiceName, kVllmEngineServiceName};
  drain.start_draining = [this] { service_->SetDraining(true); };
  drain.live_requests = [this] { return static_cast<int64_t>(service_->inflight()); };
  drain.end_remaining = [this, drain_timeout_ms] {
    service_->AbortAll(absl::StrCat("router ", config_.node_name,
                                    " shut down: the drain after SIGTERM ran past "
                                    "--drain-timeout-ms (",
                                    drain_timeout_ms, " ms)"));
  };
  drain.timeout = absl::Milliseconds(drain_timeout_ms);
  const int64_t left = serve_->Drain(drain);
  openai_.reset();
  serve_.reset();  // joins the gRPC server's threads
  std::cout << "router: stopped; " << left << " requests were open at the drain timeout"
            << std::endl;
  return left;
}

}  // namespace fluxion::cluster
