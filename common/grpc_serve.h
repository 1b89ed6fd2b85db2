// The serving life every Fluxion server role shares (router, prefill node, decode node), in one
// place: the /metrics endpoint and the gRPC server started with the health service, the port
// files written, SIGTERM or SIGINT awaited, the drain run with its deadline, the servers stopped.
// The role roots (decode/serving/decode_worker.h, prefill/prefill_worker.h,
// cluster/router_server.h) own one GrpcServe each and say only what differs: their services,
// readiness and drain plan.
//
// Thread-compatible: the role's main thread drives it.
#ifndef FLUXION_COMMON_GRPC_SERVE_H_
#define FLUXION_COMMON_GRPC_SERVE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/flag_set.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/server_main.h"
#include "grpcpp/grpcpp.h"

namespace fluxion::serving {

// Where a role serves: the flags every server takes.
struct ServeConfig {
  std::string listen;             // gRPC "host:port"; port 0 picks a free one
  std::string port_file;          // gets the bound gRPC port once serving (empty: none)
  std::string metrics_listen;     // /metrics "host:port" (empty: no endpoint)
  std::string metrics_port_file;  // gets the bound /metrics port (empty: none)
  std::shared_ptr<grpc::ServerCredentials> credentials;  // nullptr: insecure
};

// Registers --listen, --port-file, --metrics-listen and --metrics-port-file into `c` (its
// values are the defaults); `listen_help` says what the gRPC address serves and its usual value.
void RegisterServeFlags(FlagSet& flags, const std::string& listen_help, ServeConfig* c);

class GrpcServe {
 public:
  // Starts /metrics on config.metrics_listen (when set), its /readyz answering `ready` from the
  // start (null: whether SetServing last said true, until Drain), then the gRPC server of
  // `services` (the role's own first; each must outlive this).
  // The metrics endpoint starts first so that a scrape never finds a server it cannot count.
  // Unavailable (never InvalidArgument) when the endpoint cannot start, naming --metrics-listen,
  // or the server cannot (StartGrpcServer).
  static absl::StatusOr<std::unique_ptr<GrpcServe>> Start(const ServeConfig& config,
                                                          std::vector<grpc::Service*> services,
                                                          metrics::Registry* registry,
                                                          std::function<bool()> ready);
  // Shuts the gRPC server down if Drain has not (cancelling whatever is still open) and joins its
  // threads; stops /metrics.
  ~GrpcServe();
  GrpcServe(const GrpcServe&) = delete;
  GrpcServe& operator=(const GrpcServe&) = delete;

  int port() const { return port_; }
  // The bound /metrics port, 0 without the endpoint.
  int metrics_port() const { return metrics_ != nullptr ? metrics_->port() : 0; }
  grpc::Server* server() const { return server_.get(); }

  // Readiness of each of `names` in the gRPC health service (and of /readyz without a `ready` of
  // the role's); the server's overall health (""), which liveness probes ask, stays SERVING.
  void SetServing(const std::vector<std::string>& names, bool serving);
  // The metrics port file, then the gRPC one: a reader that sees the gRPC port finds both.
  void WritePortFiles() const;
  // Not ready any more, then DrainAndShutdown (common/server_main.h), then the /metrics
  // endpoint stops: no new call or
  // scrape reaches the role afterwards (the destructor joins the gRPC server's threads). Returns
  // the requests still live when the plan's timeout passed. Call once.
  int64_t Drain(const DrainPlan& plan);

 private:
  GrpcServe() = default;

  // Declared first, destroyed last: its /readyz callback may read what the services read.
  std::unique_ptr<metrics::MetricsHttpServer> metrics_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::atomic<bool> serving_{false};  // SetServing's last word; read by /readyz's thread
  bool shut_down_ = false;
  std::string port_file_, metrics_port_file_;
};

// Blocks SIGTERM and SIGINT in the calling thread and every thread it starts later, so that only
// WaitForStopSignal takes them. For a role that must not be killed by a signal during start-up,
// and whose threads must never be interrupted by one; call before any thread starts.
void BlockStopSignals();

// Blocks until SIGTERM or SIGINT arrives, calling `on_tick` (when set) at once and then every
// `tick`. After BlockStopSignals the signal is taken synchronously (sigtimedwait, so one that
// arrived during start-up counts); otherwise handlers for both are installed now.
void WaitForStopSignal(absl::Duration tick = absl::Milliseconds(200),
                       const std::function<void()>& on_tick = nullptr);

// The exit code of a server command whose root failed: 2 for a configuration error
// (InvalidArgument), 1 for anything else (a model, a port or a device that cannot be had).
// Prints "error: <message>" to stderr.
int ReportStartError(const absl::Status& status);

// Every root's Serve: root.Start(), then until SIGTERM or SIGINT (calling `on_tick` every 200 ms
// meanwhile, when set), then root.Shutdown(), the drain. Start's error when it fails.
template <typename Root>
absl::Status ServeUntilStopped(Root& root, const std::function<void()>& on_tick = nullptr) {
  if (absl::Status started = root.Start(); !started.ok()) return started;
  WaitForStopSignal(absl::Milliseconds(200), on_tick);
  root.Shutdown();
  return absl::OkStatus();
}

// The end of every server command, once its flags are in `config`: Root::Create(config), then
// Root::Serve() until SIGTERM or SIGINT and its drain. Returns the exit code: 0, or
// ReportStartError's (a failure to serve, such as a port in use, is never a usage error).
template <typename Root, typename Config>
int CreateAndServe(Config config) {
  absl::StatusOr<std::unique_ptr<Root>> root = Root::Create(std::move(config));
  if (!root.ok()) return ReportStartError(root.status());
  if (absl::Status served = (*root)->Serve(); !served.ok()) {
    return ReportStartError(absl::UnavailableError(served.message()));
  }
  return 0;
}

}  // namespace fluxion::serving

#endif  // FLUXION_COMMON_GRPC_SERVE_H_
