// Test helpers for the serving integration tests: real `fluxion prefill` / `fluxion decode`
// processes on this host (real gRPC, real UCX over TCP loopback or shared memory) and a small
// DecodeService client. Every wait has a deadline.
#ifndef FLUXION_TESTS_SERVING_CLUSTER_H_
#define FLUXION_TESTS_SERVING_CLUSTER_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/wait_testing.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fluxion::testing {

// Where the tests find the trained model (FLUXION_SOURCE_DIR/models/fluxion-tiny-retrieval).
std::string TinyModelDir();

// UCX on one host: "tcp" (TCP on lo, peer error handling on) or "sm" (shared memory, off).
std::vector<std::string> UcxArgs(const std::string& tls);

// A child process running `fluxion <args>`, killed (SIGKILL) when destroyed unless stopped.
class ServerProcess {
 public:
  // Starts `fluxion <command> <args> --listen 127.0.0.1:0 --port-file ... --metrics-listen
  // 127.0.0.1:0 --metrics-port-file ...` (and --cpu-threads 1 unless `command` is router) and
  // waits (up to 60 s) until it serves. Returns null, with
  // the log printed, if it does not.
  static std::unique_ptr<ServerProcess> Start(const std::string& command,
                                              std::vector<std::string> args);
  ~ServerProcess();

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }
  int metrics_port() const { return metrics_port_; }  // its Prometheus /metrics endpoint
  void Kill();  // SIGKILL and reap
  // SIGTERM, then wait up to `timeout` for the process to exit; true when it exited by itself.
  bool Terminate(absl::Duration timeout);
  void Signal(int signal);
  std::string Log() const;

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string dir_;
};

struct GenerateResult {
  grpc::Status status;
  std::vector<uint32_t> tokens;
  bool has_complete = false;
  fluxion::v1::GenerateComplete complete;
  bool has_error = false;
  fluxion::v1::GenerateError error;
};

class DecodeClient {
 public:
  explicit DecodeClient(const std::string& address);
  // `on_accepted` (optional) gets the call's abort token (`fluxion-abort-token` initial metadata,
  // "" if none) as soon as the server accepted the call, while the stream is still open.
  GenerateResult Generate(const fluxion::v1::GenerateRequest& request,
                          absl::Duration deadline = absl::Seconds(60),
                          const std::function<void(const std::string&)>& on_accepted = nullptr);
  fluxion::v1::DecodeLoad Load();
  fluxion::v1::DecodeService::Stub& stub() { return *stub_; }
  // Polls GetLoad until the node is idle -- every KV page free and no request running, prefilling
  // or waiting -- or `timeout` passes; returns the last load.
  fluxion::v1::DecodeLoad WaitAllPagesFree(absl::Duration timeout = kGenerousWait);
  // Polls GetLoad until `done(load)` or `timeout` passes; whether it held.
  bool WaitForLoad(const std::function<bool(const fluxion::v1::DecodeLoad&)>& done,
                   absl::Duration timeout = kGenerousWait);

 private:
  std::unique_ptr<fluxion::v1::DecodeService::Stub> stub_;
};

fluxion::v1::PrefillLoad PrefillLoadOf(const std::string& address);

// The value of `series` (e.g. `fluxion_prefill_requests_total{code="OK"}`) in `server`'s /metrics
// now; NaN when the series is absent or the endpoint does not answer.
double MetricOf(const ServerProcess& server, const std::string& series);

// A greedy request over `prompt` for `max_tokens` tokens (EOS ignored) with `policy` ("" = the
// node's default) through `prefill_address` ("" = the node's default).
fluxion::v1::GenerateRequest GreedyRequest(const std::string& id, const std::vector<uint32_t>& prompt,
                                           uint32_t max_tokens, const std::string& policy,
                                           const std::string& prefill_address);

// Byte-token prompt of `text`.
std::vector<uint32_t> BytePrompt(const std::string& text);

}  // namespace fluxion::testing

#endif  // FLUXION_TESTS_SERVING_CLUSTER_H_
