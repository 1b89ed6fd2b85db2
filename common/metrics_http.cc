#include "common/metrics_http.h"

#include <cstring>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "civetweb.h"

namespace fluxion::metrics {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

int HandleMetrics(mg_connection* conn, void* cbdata) {
  const auto* registry = static_cast<const Registry*>(cbdata);
  const mg_request_info* info = mg_get_request_info(conn);
  if (info == nullptr || (std::strcmp(info->request_method, "GET") != 0 &&
                          std::strcmp(info->request_method, "HEAD") != 0)) {
    mg_send_http_error(conn, 405, "only GET /metrics");
    return 405;
  }
  std::string body = registry->Render();
  mg_send_http_ok(conn, kContentType, static_cast<long long>(body.size()));
  if (std::strcmp(info->request_method, "GET") == 0) mg_write(conn, body.data(), body.size());
  return 200;
}

// civetweb logs to stderr by default; keep its messages out of the server's output unless they
// are errors the operator needs.
int LogMessage(const mg_connection*, const char*) { return 1; }

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, const Registry* registry) {
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->registry_ = registry;
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.log_message = LogMessage;
  // Two threads: scrapes are rare (every 15 s or so) and rendering takes microseconds.
  const char* options[] = {"listening_ports", address.c_str(), "num_threads", "2",
                           "request_timeout_ms", "10000", nullptr};
  server->context_ = mg_start(&callbacks, nullptr, options);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on '", address, "' (port in use or bad address)"));
  }
  mg_set_request_handler(server->context_, "/metrics$", HandleMetrics,
                         const_cast<Registry*>(registry));
  mg_server_port ports[4];
  int n = mg_get_server_ports(server->context_, 4, ports);
  if (n < 1) {
    return absl::InternalError(absl::StrCat("metrics: no port bound for '", address, "'"));
  }
  server->port_ = ports[0].port;
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ != nullptr) mg_stop(context_);
}

}  // namespace fluxion::metrics
