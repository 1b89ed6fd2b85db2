// The start-up steps every Fluxion server (router, prefill node, decode node) shares: the gRPC
// server with the default health service, the optional /metrics endpoint, and port files for
// the processes that start servers on port 0 (tests, `fluxion local`).
//
// Thread-compatible; call from the server's main thread.
#ifndef FLUXION_COMMON_SERVER_MAIN_H_
#define FLUXION_COMMON_SERVER_MAIN_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "grpcpp/grpcpp.h"

namespace fluxion::serving {

// Serves `service` on `listen` ("host:port"; port 0 picks a free one, written to *port) with
// grpc's default health service enabled (the caller sets its service name's status once ready).
// Unavailable when the address cannot be bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(const std::string& listen,
                                                             grpc::Service* service, int* port);

// The /metrics endpoint on `listen`, or nullptr when `listen` is empty (the flag's "off").
absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> StartMetricsIfRequested(
    const std::string& listen, metrics::Registry* registry);

// Writes `value` and a newline to `path` (write to path.tmp, then rename, so a reader never sees
// a partial number). Does nothing for an empty path.
void WritePortFile(const std::string& path, int value);

}  // namespace fluxion::serving

#endif  // FLUXION_COMMON_SERVER_MAIN_H_
