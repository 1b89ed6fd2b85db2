#include "common/metrics_http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/ipv4_address.h"
#include "microhttpd.h"

namespace fluxion::metrics {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

MHD_Result Reply(MHD_Connection* connection, unsigned int code, const std::string& body,
                 const char* content_type) {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", content_type);
  MHD_Result result = MHD_queue_response(connection, code, response);
  MHD_destroy_response(response);
  return result;
}

MHD_Result Handle(void* cls, MHD_Connection* connection, const char* url, const char* method,
                  const char*, const char*, size_t*, void**) {
  const auto* server = static_cast<const MetricsHttpServer*>(cls);
  const bool metrics = std::strcmp(url, "/metrics") == 0;
  const bool readyz = std::strcmp(url, "/readyz") == 0, livez = std::strcmp(url, "/livez") == 0;
  if (!metrics && !readyz && !livez) {
    return Reply(connection, MHD_HTTP_NOT_FOUND,
                 "only /metrics, /readyz and /livez are served here\n", "text/plain");
  }
  if (std::strcmp(method, "GET") != 0 && std::strcmp(method, "HEAD") != 0) {
    return Reply(connection, MHD_HTTP_METHOD_NOT_ALLOWED, absl::StrCat("GET ", url, "\n"),
                 "text/plain");
  }
  if (livez) return Reply(connection, MHD_HTTP_OK, "ok\n", "text/plain");
  if (readyz) {
    return server->Ready()
               ? Reply(connection, MHD_HTTP_OK, "ready\n", "text/plain")
               : Reply(connection, MHD_HTTP_SERVICE_UNAVAILABLE, "not ready\n", "text/plain");
  }
  return Reply(connection, MHD_HTTP_OK, server->registry()->Render(), kContentType);
}

// "host:port" or "port" -> IPv4 socket address; host may be a name ("localhost") or "0.0.0.0".
absl::StatusOr<sockaddr_in> ParseAddress(const std::string& address) {
  std::string host = "0.0.0.0", port_text = address;
  if (size_t colon = address.rfind(':'); colon != std::string::npos) {
    host = address.substr(0, colon);
    port_text = address.substr(colon + 1);
  }
  int port = -1;
  if (!absl::SimpleAtoi(port_text, &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: '", address, "' is not host:port (e.g. 0.0.0.0:9100)"));
  }
  return ResolveIpv4(host, port, "metrics");
}

}  // namespace

MetricsHttpServer::Limits MetricsHttpServer::DefaultLimits() {
  // A quarter of the process's descriptors at most: idle HTTP clients must never starve the gRPC
  // server and the UCX transport of descriptors (accept would fail with EMFILE there too).
  rlimit files{};
  rlim_t budget = 1024;  // the usual soft limit, when it cannot be read
  if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
    budget = files.rlim_cur == RLIM_INFINITY ? kMaxConnections * 4 : files.rlim_cur;
  }
  Limits limits;
  limits.max_connections =
      static_cast<unsigned int>(std::clamp<rlim_t>(budget / 4, 16, kMaxConnections));
  // One address holds half the table at most, so a scraper from any other address always finds
  // room, however many connections one client leaves open.
  limits.max_connections_per_address = limits.max_connections / 2;
  return limits;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, const Registry* registry) {
  return Start(address, registry, DefaultLimits());
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, const Registry* registry, const Limits& limits) {
  auto addr = ParseAddress(address);
  if (!addr.ok()) return addr.status();
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->registry_ = registry;
  // One internal thread: scrapes are rare and rendering takes microseconds. Its stack is set
  // explicitly: static TLS of libraries in the `fluxion` binary (OpenBLAS ~60 KiB, glog ~30 KiB)
  // is carved from every thread's stack, which overflowed civetweb's fixed 100 KiB threads.
  //
  // epoll, and explicit connection limits: with poll() and libmicrohttpd's default limit
  // (FD_SETSIZE - 4 = 1020 connections), 1,100 clients that connect and send nothing filled the
  // table and a scrape waited in the listen backlog until idle ones timed out (10 s).
  const unsigned int flags =
      MHD_USE_INTERNAL_POLLING_THREAD |
      (MHD_is_feature_supported(MHD_FEATURE_EPOLL) == MHD_YES ? MHD_USE_EPOLL : MHD_USE_POLL);
  server->daemon_ = MHD_start_daemon(
      flags, 0, nullptr, nullptr, &Handle, server.get(), MHD_OPTION_SOCK_ADDR, &*addr,
      MHD_OPTION_THREAD_STACK_SIZE, static_cast<size_t>(1) << 20, MHD_OPTION_CONNECTION_TIMEOUT,
      static_cast<unsigned int>(absl::ToInt64Seconds(limits.idle_timeout)),
      MHD_OPTION_CONNECTION_LIMIT, limits.max_connections, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      limits.max_connections_per_address, MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on '", address, "' (port in use?)"));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr ? info->port : ntohs(addr->sin_port);
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

void MetricsHttpServer::SetReadiness(std::function<bool()> ready) {
  absl::MutexLock lock(&mu_);
  ready_ = std::move(ready);
}

bool MetricsHttpServer::Ready() const {
  absl::MutexLock lock(&mu_);
  return ready_ && ready_();
}

}  // namespace fluxion::metrics
