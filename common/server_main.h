// The start-up steps every Fluxion server (router, prefill node, decode node) shares: the gRPC
// server with the default health service, the optional /metrics endpoint, and port files for
// the processes that start servers on port 0 (tests, `fluxion local`).
//
// Thread-compatible; call from the server's main thread.
#ifndef FLUXION_COMMON_SERVER_MAIN_H_
#define FLUXION_COMMON_SERVER_MAIN_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "common/grpc_transport.h"
#include "common/metrics_http.h"
#include "grpcpp/grpcpp.h"

namespace fluxion::serving {

// How a server is built besides its address and service.
struct GrpcServerOptions {
  std::shared_ptr<grpc::ServerCredentials> credentials;  // nullptr: insecure
  KeepalivePolicy keepalive;  // the ping policy its clients use (grpc_transport.h)
  // More services on the same port (the router's VllmEngine); must outlive the server.
  std::vector<grpc::Service*> more_services;
};

// Serves `service` on `listen` ("host:port"; port 0 picks a free one, written to *port) with
// grpc's default health service enabled (the caller sets its service name's status once ready),
// the keepalive policy every Fluxion client uses, and INVALID_ARGUMENT for requests that do not
// parse. Unavailable when the address cannot be bound or the TLS key does not match.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(const std::string& listen,
                                                             grpc::Service* service, int* port,
                                                             const GrpcServerOptions& options = {});

// The default address servers listen on: loopback, so a server started without --listen is not
// reachable from other hosts (docs/TLS.md). Deployments pass 0.0.0.0:<port>.
inline std::string LoopbackAddress(int port) { return "127.0.0.1:" + std::to_string(port); }

// The /metrics endpoint on `listen`, or nullptr when `listen` is empty (the flag's "off"); it
// also exports the process's memory (common/memory_metrics.h).
absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> StartMetricsIfRequested(
    const std::string& listen, metrics::Registry* registry);

// Writes the metrics port file (when `metrics` runs) and then the gRPC one, so a reader that sees
// the gRPC port file also finds the metrics port.
void WritePortFiles(const std::string& port_file, int port, const std::string& metrics_port_file,
                    const metrics::MetricsHttpServer* metrics);

// How a server drains on SIGTERM (DrainAndShutdown).
struct DrainPlan {
  // Health service names that go NOT_SERVING (readiness). The server's overall health (""),
  // which liveness probes ask, stays SERVING: a draining pod is alive and must not be restarted.
  std::vector<std::string> service_names;
  // Makes the service refuse new requests (UNAVAILABLE, naming the drain).
  std::function<void()> start_draining;
  // Requests still in progress.
  std::function<int64_t()> live_requests;
  // Called once `timeout` passed with requests still live: ends each with a clear error the
  // client can act on (or nullptr: the server's shutdown cancels them).
  std::function<void()> end_remaining;
  absl::Duration timeout = absl::Seconds(30);
  // After end_remaining, how long the requests get to write their error and end.
  absl::Duration end_grace = absl::Seconds(2);
};

// Drains a server: new requests refused, `service_names` NOT_SERVING, running ones get until
// `timeout` to finish, then end_remaining ends the rest and they get `end_grace`, then the server
// shuts down (1 s more for calls still open, which it cancels). The whole takes at most
// timeout + end_grace + 1 s, the bound the pods' terminationGracePeriodSeconds covers (k8s/).
// Returns the requests still live when `timeout` passed.
int64_t DrainAndShutdown(grpc::Server* server, const DrainPlan& plan);

// The bound on the --drain-timeout-ms flag every server takes: 0 ms to 1 hour.
absl::Status ValidateDrainTimeoutMs(int64_t drain_timeout_ms);

// Writes `value` and a newline to `path` (write to path.tmp, then rename, so a reader never sees
// a partial number). Does nothing for an empty path.
void WritePortFile(const std::string& path, int value);

}  // namespace fluxion::serving

#endif  // FLUXION_COMMON_SERVER_MAIN_H_
