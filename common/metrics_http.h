// Serves a metrics::Registry at HTTP GET /metrics in the Prometheus text format (and /readyz,
// /livez for probes that cannot use gRPC health), with GNU
// libmicrohttpd (Debian's libmicrohttpd-dev, an embeddable HTTP server) on one internal thread.
// Every `fluxion` server (router, prefill, decode) starts one next to its gRPC port.
//
// A separate target from fluxion::metrics so that only servers link an HTTP server.
//
// Thread-safe: the server renders on its own thread; the registry is thread-safe.
#ifndef FLUXION_COMMON_METRICS_HTTP_H_
#define FLUXION_COMMON_METRICS_HTTP_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"

struct MHD_Daemon;

namespace fluxion::metrics {

class MetricsHttpServer {
 public:
  // Bounds on what clients may hold (docs/METRICS.md, Implementation). The member defaults are
  // an example; Start() without limits uses DefaultLimits().
  struct Limits {
    unsigned int max_connections = 1024;
    // Connections from one IP address at most; beyond that a new one is closed at once.
    unsigned int max_connections_per_address = 512;
    // A connection that sends nothing for this long is closed (whole seconds).
    absl::Duration idle_timeout = absl::Seconds(10);
  };
  static constexpr unsigned int kMaxConnections = 4096;
  // kMaxConnections, or a quarter of RLIMIT_NOFILE when that is less; half of it per address.
  static Limits DefaultLimits();

  // Starts listening on `address` ("host:port" or "port", IPv4; port 0 picks a free one) with
  // DefaultLimits(). `registry` must outlive the server. UNAVAILABLE if the port cannot be bound,
  // INVALID_ARGUMENT for a malformed address.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  const Registry* registry);
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  const Registry* registry,
                                                                  const Limits& limits);
  // Stops listening and waits for requests in flight.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port (the real one when 0 was asked for).
  int port() const { return port_; }

  // GET /readyz answers 200 while `ready` returns true, else 503 (503 until this is called);
  // GET /livez answers 200 while the process serves HTTP. For Kubernetes probes where the gRPC
  // port speaks TLS, which kubelet's gRPC probes cannot (docs/DEPLOY.md, "TLS"). `ready` runs on
  // the HTTP thread; whatever it reads must outlive this server.
  void SetReadiness(std::function<bool()> ready);
  bool Ready() const;

  const Registry* registry() const { return registry_; }

 private:
  MetricsHttpServer() = default;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  const Registry* registry_ = nullptr;
  mutable absl::Mutex mu_;
  std::function<bool()> ready_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fluxion::metrics

#endif  // FLUXION_COMMON_METRICS_HTTP_H_
