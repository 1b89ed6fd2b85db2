#include "common/server_main.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/memory_metrics.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"

namespace fluxion::serving {

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(const std::string& listen,
                                                             grpc::Service* service, int* port,
                                                             const GrpcServerOptions& options) {
  grpc::EnableDefaultHealthCheckService(true);
  // Server reflection on every server, so grpcurl and the like work without our protos (they are
  // public: proto/). Registered before the builder is made: the plugin attaches to new builders.
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  *port = 0;
  std::shared_ptr<grpc::ServerCredentials> credentials = options.credentials;
  if (credentials == nullptr) credentials = grpc::InsecureServerCredentials();
  builder.AddListeningPort(listen, credentials, port);
  builder.RegisterService(service);
  for (grpc::Service* more : options.more_services) builder.RegisterService(more);
  SetServerPingPolicy(options.keepalive, &builder);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(UnparsableRequestInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve on ", listen, " (port in use or bad address",
        options.credentials != nullptr ? ", or --tls-key does not match --tls-cert" : "", ")"));
  }
  return server;
}

absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> StartMetricsIfRequested(
    const std::string& listen, metrics::Registry* registry) {
  if (listen.empty()) return std::unique_ptr<metrics::MetricsHttpServer>();
  metrics::AddMemoryMetrics(registry);  // every server's: leak or allocator? (memory_metrics.h)
  return metrics::MetricsHttpServer::Start(listen, registry);
}

void WritePortFiles(const std::string& port_file, int port, const std::string& metrics_port_file,
                    const metrics::MetricsHttpServer* metrics) {
  if (metrics != nullptr) WritePortFile(metrics_port_file, metrics->port());
  WritePortFile(port_file, port);
}

int64_t DrainAndShutdown(grpc::Server* server, const DrainPlan& plan) {
  // Refusing first: whoever sees NOT_SERVING finds new requests refused too.
  plan.start_draining();
  for (const std::string& name : plan.service_names) {
    server->GetHealthCheckService()->SetServingStatus(name, false);
  }
  const absl::Time deadline = absl::Now() + plan.timeout;
  while (plan.live_requests() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  const int64_t left = plan.live_requests();
  if (left > 0 && plan.end_remaining) {
    plan.end_remaining();
    const absl::Time ended = absl::Now() + plan.end_grace;
    while (plan.live_requests() > 0 && absl::Now() < ended) absl::SleepFor(absl::Milliseconds(20));
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return left;
}

absl::Status ValidateDrainTimeoutMs(int64_t drain_timeout_ms) {
  if (drain_timeout_ms < 0 || drain_timeout_ms > 3600 * 1000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--drain-timeout-ms must be in [0, 3600000] (an hour), got ", drain_timeout_ms));
  }
  return absl::OkStatus();
}

void WritePortFile(const std::string& path, int value) {
  if (path.empty()) return;
  std::ofstream(path + ".tmp") << value << "\n";
  std::rename((path + ".tmp").c_str(), path.c_str());
}

}  // namespace fluxion::serving
