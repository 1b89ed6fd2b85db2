#include "common/grpc_serve.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "grpcpp/health_check_service_interface.h"

namespace fluxion::serving {

void RegisterServeFlags(FlagSet& flags, const std::string& listen_help, ServeConfig* c) {
  flags.String("listen", &c->listen, listen_help);
  flags.String("port-file", &c->port_file,
               "write the bound gRPC port into this file once serving");
  flags.String("metrics-listen", &c->metrics_listen,
               "HTTP address for Prometheus /metrics, host:port (port 0 picks a free port; "
               "empty: no endpoint)");
  flags.String("metrics-port-file", &c->metrics_port_file,
               "write the bound /metrics port into this file once serving");
}

absl::StatusOr<std::unique_ptr<GrpcServe>> GrpcServe::Start(const ServeConfig& config,
                                                            std::vector<grpc::Service*> services,
                                                            metrics::Registry* registry,
                                                            std::function<bool()> ready) {
  if (services.empty()) return absl::InternalError("GrpcServe::Start: no service (a bug)");
  std::unique_ptr<GrpcServe> serve(new GrpcServe());
  serve->port_file_ = config.port_file;
  serve->metrics_port_file_ = config.metrics_port_file;
  absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> metrics =
      StartMetricsIfRequested(config.metrics_listen, registry);
  if (!metrics.ok()) {
    // Unavailable whatever the endpoint said: the role cannot start, which is not a usage error
    // (ReportStartError's exit code 2).
    return absl::UnavailableError(absl::StrCat("--metrics-listen ", config.metrics_listen, ": ",
                                               metrics.status().ToString()));
  }
  serve->metrics_ = std::move(*metrics);
  if (ready == nullptr) ready = [s = serve.get()] { return s->serving_.load(); };
  if (serve->metrics_ != nullptr) serve->metrics_->SetReadiness(std::move(ready));
  GrpcServerOptions options;
  options.credentials = config.credentials;
  options.more_services.assign(services.begin() + 1, services.end());
  FLUXION_ASSIGN_OR_RETURN(serve->server_,
                           StartGrpcServer(config.listen, services[0], &serve->port_, options));
  return serve;
}

GrpcServe::~GrpcServe() {
  if (server_ == nullptr) return;
  if (!shut_down_) server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
}

void GrpcServe::SetServing(const std::vector<std::string>& names, bool serving) {
  for (const std::string& name : names) {
    server_->GetHealthCheckService()->SetServingStatus(name, serving);
  }
  serving_ = serving;
}

void GrpcServe::WritePortFiles() const {
  serving::WritePortFiles(port_file_, port_, metrics_port_file_, metrics_.get());
}

int64_t GrpcServe::Drain(const DrainPlan& plan) {
  serving_ = false;
  const int64_t left = DrainAndShutdown(server_.get(), plan);
  shut_down_ = true;
  metrics_.reset();
  return left;
}

namespace {

std::atomic<bool> g_stop{false};
void OnStopSignal(int) { g_stop = true; }

sigset_t StopSignalSet() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  return signals;
}

bool StopSignalsBlocked() {
  sigset_t current;
  pthread_sigmask(SIG_BLOCK, nullptr, &current);
  return sigismember(&current, SIGTERM) == 1 && sigismember(&current, SIGINT) == 1;
}

}  // namespace

void BlockStopSignals() {
  // The flag handler first: a thread that started before the mask (gRPC's executors can) may
  // still take the signal, and must then stop the server, not kill the process unhandled.
  std::signal(SIGTERM, OnStopSignal);
  std::signal(SIGINT, OnStopSignal);
  const sigset_t signals = StopSignalSet();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
}

void WaitForStopSignal(absl::Duration tick, const std::function<void()>& on_tick) {
  if (StopSignalsBlocked()) {
    // Every thread inherited the mask: the signal waits, pending, for this call to take it.
    const sigset_t signals = StopSignalSet();
    const timespec wait = absl::ToTimespec(tick);
    while (!g_stop) {
      if (on_tick) on_tick();
      const int sig = sigtimedwait(&signals, nullptr, &wait);
      if (sig == SIGINT || sig == SIGTERM) return;
    }
    return;
  }
  // Any thread may take the signal here; the handler only sets a flag this thread polls.
  std::signal(SIGTERM, OnStopSignal);
  std::signal(SIGINT, OnStopSignal);
  absl::Time next_tick = absl::InfinitePast();
  while (!g_stop) {
    if (on_tick && absl::Now() >= next_tick) {
      on_tick();
      next_tick = absl::Now() + tick;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

int ReportStartError(const absl::Status& status) {
  std::cerr << "error: " << status.message() << "\n";
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace fluxion::serving
