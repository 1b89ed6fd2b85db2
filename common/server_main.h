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

// The /metrics endpoint on `listen`, or nullptr when `listen` is empty (the flag's "off").
absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> StartMetricsIfRequested(
    const std::string& listen, metrics::Registry* registry);

// Writes the metrics port file (when `metrics` runs) and then the gRPC one, so a reader that sees
// the gRPC port file also finds the metrics port.
void WritePortFiles(const std::string& port_file, int port, const std::string& metrics_port_file,
                    const metrics::MetricsHttpServer* metrics);

// Blocks until SIGTERM or SIGINT arrives (installs handlers for both).
void WaitForStopSignal();

// Drains a node: its service name and the server's overall health go NOT_SERVING,
// `start_draining` makes the service refuse new requests (UNAVAILABLE), running ones get until
// `timeout` to finish, then the server shuts down (5 s grace). Returns the requests still live when
// the drain gave up.
int64_t DrainAndShutdown(grpc::Server* server, const std::string& service_name,
                         const std::function<void()>& start_draining,
                         const std::function<int64_t()>& live_requests, absl::Duration timeout);

// Writes `value` and a newline to `path` (write to path.tmp, then rename, so a reader never sees
// a partial number). Does nothing for an empty path.
void WritePortFile(const std::string& path, int value);

}  // namespace fluxion::serving

#endif  // FLUXION_COMMON_SERVER_MAIN_H_
