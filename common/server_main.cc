#include "common/server_main.h"

#include <cstdio>
#include <fstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fluxion::serving {

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(const std::string& listen,
                                                             grpc::Service* service, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  *port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve on ", listen, " (port in use or bad address)"));
  }
  return server;
}

absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> StartMetricsIfRequested(
    const std::string& listen, metrics::Registry* registry) {
  if (listen.empty()) return std::unique_ptr<metrics::MetricsHttpServer>();
  return metrics::MetricsHttpServer::Start(listen, registry);
}

void WritePortFile(const std::string& path, int value) {
  if (path.empty()) return;
  std::ofstream(path + ".tmp") << value << "\n";
  std::rename((path + ".tmp").c_str(), path.c_str());
}

}  // namespace fluxion::serving
