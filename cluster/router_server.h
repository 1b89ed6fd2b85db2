// The router's composition root (`fluxion router`): built from one RouterServerConfig, it owns
// every part of the router (backend discovery and health, RouterService, the vllm-compatible
// VllmEngine service, the OpenAI HTTP front end, metrics and the gRPC server) and their order of
// start and stop. The command only maps flags to the config (cluster/router_command.cc).
//
// Thread-compatible: one thread creates, serves and shuts the router down.
#ifndef FLUXION_CLUSTER_ROUTER_SERVER_H_
#define FLUXION_CLUSTER_ROUTER_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cluster/backend_health.h"
#include "cluster/backends.h"
#include "cluster/openai_serving.h"
#include "cluster/router_service.h"
#include "cluster/vllm_engine_command.h"
#include "common/grpc_security.h"
#include "common/grpc_serve.h"

namespace fluxion::cluster {

// Everything a router is built from; the flags of `fluxion router` say what each means.
struct RouterServerConfig {
  std::string node_name;       // empty: <hostname>/<unix seconds>
  serving::ServeConfig serve;  // serve.credentials: Create builds them from `tls`
  serving::ServerTlsOptions tls;
  int64_t drain_timeout_ms = 30000;

  // The prefill and decode nodes, how they are watched and reached.
  std::vector<std::string> decode, prefill, decode_dns, prefill_dns;
  int64_t poll_ms = 200;
  int64_t health_failures = HealthHysteresisOptions{}.failures_to_eject;
  int64_t health_successes = HealthHysteresisOptions{}.successes_to_admit;
  serving::ClientTlsOptions backend_tls;

  // How requests are relayed.
  double shed_kv_usage = 0.95;
  int64_t max_attempts = 3, deadline_grace_ms = 500;

  // The text front ends: one model directory for both (empty: token ids only), and the OpenAI
  // HTTP API's own settings (its model_dir and tokenizer are filled in by Create).
  std::string model_dir;
  OpenAiFlags openai;
};

class RouterServer {
 public:
  // Loads the tokenizer (with model_dir), reads the certificates, blocks SIGTERM and SIGINT (so
  // that one arriving during start-up drains instead of killing), starts backend discovery and
  // builds the services. InvalidArgument for a bad config or file (the command's exit code 2).
  static absl::StatusOr<std::unique_ptr<RouterServer>> Create(RouterServerConfig config);
  // Shuts down (Shutdown) if still serving.
  ~RouterServer();
  RouterServer(const RouterServer&) = delete;
  RouterServer& operator=(const RouterServer&) = delete;

  // Starts /metrics, the gRPC server (DecodeService and VllmEngine) and the OpenAI HTTP API, and
  // writes the port files. Readiness follows the decode nodes (Serve keeps it up to date).
  // Unavailable when a port cannot be bound.
  absl::Status Start();
  // Start, then until SIGTERM or SIGINT keeps readiness NOT_SERVING while no decode node is
  // healthy, then Shutdown.
  absl::Status Serve();
  // The drain: readiness NOT_SERVING (liveness stays SERVING), new requests refused, open ones
  // get --drain-timeout-ms and are then aborted with a reason. Returns the requests open at the
  // timeout. Idempotent; 0 when not serving.
  int64_t Shutdown();

  int port() const { return serve_ != nullptr ? serve_->port() : 0; }

 private:
  explicit RouterServer(RouterServerConfig config) : config_(std::move(config)) {}
  absl::Status StartBackends();
  // Ready while a decode node is healthy and the router is not draining: /readyz, the
  // VllmEngine HealthCheck and the OpenAI API's /health all ask this.
  bool Ready() const;
  // Serve's tick: the health service's readiness follows the decode nodes.
  void FollowDecodeHealth();

  RouterServerConfig config_;
  // Declared in the order they are built, so they are destroyed in reverse.
  std::unique_ptr<Backends> backends_;
  std::unique_ptr<RouterService> service_;
  std::atomic<bool> draining_{false};
  std::unique_ptr<VllmEngineSetup> vllm_;
  std::unique_ptr<serving::GrpcServe> serve_;
  // A client of serve_'s own DecodeService: goes first.
  std::unique_ptr<OpenAiServing> openai_;
  bool serving_ = false;  // the health service's last readiness (FollowDecodeHealth)
};

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_ROUTER_SERVER_H_
