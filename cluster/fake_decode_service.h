// Test-only fakes of the fluxion.v1 services on real gRPC over loopback: a decode node that streams
// tokens on a fixed timetable (or fails on request), and a prefill node that only answers GetLoad.
// Used by the replayer and router tests; the real services are issue 6's.
//
// Thread-safe: gRPC calls the handlers on its threads; the settings are guarded by a mutex.
#ifndef FLUXION_CLUSTER_FAKE_DECODE_SERVICE_H_
#define FLUXION_CLUSTER_FAKE_DECODE_SERVICE_H_

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "fluxion/v1/decode.grpc.pb.h"
#include "fluxion/v1/prefill.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace fluxion::cluster::testing {

namespace v1 = ::fluxion::v1;

// What one Generate call did, as the fake saw it.
struct SeenRequest {
  v1::GenerateRequest request;
  std::chrono::system_clock::time_point deadline;
  bool cancelled = false;
};

class FakeDecodeService final : public v1::DecodeService::Service {
 public:
  struct Behaviour {
    std::chrono::milliseconds ttft{40};
    std::chrono::milliseconds itl{10};
    // Checked first: a non-OK status rejects the request before any output.
    std::function<grpc::Status(const v1::GenerateRequest&)> reject;
    // >= 0: after this many tokens, send `error` and end with fail_code.
    int fail_after_tokens = -1;
    grpc::StatusCode fail_code = grpc::StatusCode::UNAVAILABLE;
  };

  void SetBehaviour(Behaviour b) {
    absl::MutexLock lock(&mu_);
    behaviour_ = std::move(b);
  }
  void SetLoad(v1::DecodeLoad load) {
    absl::MutexLock lock(&mu_);
    load_ = std::move(load);
  }
  std::vector<SeenRequest> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }
  int max_concurrent() {
    absl::MutexLock lock(&mu_);
    return max_concurrent_;
  }
  std::vector<std::string> aborted() {
    absl::MutexLock lock(&mu_);
    return std::vector<std::string>(aborted_.begin(), aborted_.end());
  }

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    Behaviour b;
    size_t slot;
    {
      absl::MutexLock lock(&mu_);
      b = behaviour_;
      seen_.push_back({*request, context->deadline(), false});
      slot = seen_.size() - 1;
      max_concurrent_ = std::max(max_concurrent_, ++concurrent_);
    }
    grpc::Status status = Serve(context, *request, writer, b);
    absl::MutexLock lock(&mu_);
    --concurrent_;
    seen_[slot].cancelled = context->IsCancelled();
    return status;
  }

  grpc::Status Abort(grpc::ServerContext*, const v1::AbortRequest* request,
                     v1::AbortResponse* response) override {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : request->request_ids()) {
      aborted_.insert(id);
      response->add_aborted_request_ids(id);
    }
    return grpc::Status::OK;
  }

  grpc::Status GetLoad(grpc::ServerContext*, const v1::GetLoadRequest*,
                       v1::DecodeLoad* response) override {
    absl::MutexLock lock(&mu_);
    *response = load_;
    return grpc::Status::OK;
  }

 private:
  // Sleeps `d` in small steps; false if the call was cancelled meanwhile.
  static bool SleepUnlessCancelled(grpc::ServerContext* context, std::chrono::milliseconds d) {
    auto until = std::chrono::steady_clock::now() + d;
    while (std::chrono::steady_clock::now() < until) {
      if (context->IsCancelled()) return false;
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
          std::chrono::milliseconds(2), until - std::chrono::steady_clock::now()));
    }
    return !context->IsCancelled();
  }

  bool IsAborted(const std::string& id) {
    absl::MutexLock lock(&mu_);
    return aborted_.count(id) > 0;
  }

  grpc::Status Serve(grpc::ServerContext* context, const v1::GenerateRequest& request,
                     grpc::ServerWriter<v1::GenerateResponse>* writer, const Behaviour& b) {
    if (b.reject) {
      grpc::Status s = b.reject(request);
      if (!s.ok()) return s;
    }
    uint32_t tokens = request.sampling().has_max_tokens() ? request.sampling().max_tokens() : 4;
    if (!SleepUnlessCancelled(context, b.ttft)) return grpc::Status(grpc::CANCELLED, "cancelled");
    v1::GenerateResponse response;
    for (uint32_t i = 0; i < tokens; ++i) {
      if (i > 0 && !SleepUnlessCancelled(context, b.itl)) {
        return grpc::Status(grpc::CANCELLED, "cancelled");
      }
      if (b.fail_after_tokens >= 0 && static_cast<int>(i) == b.fail_after_tokens) {
        response.mutable_error()->set_code(b.fail_code);
        response.mutable_error()->set_message("fake decode: injected failure");
        writer->Write(response);
        return grpc::Status(b.fail_code, "fake decode: injected failure");
      }
      bool aborted = IsAborted(request.request_id());
      if (aborted) {
        response.mutable_complete()->set_finish_reason(v1::FINISH_REASON_ABORT);
        response.mutable_complete()->mutable_usage()->set_completion_tokens(i);
        writer->Write(response);
        return grpc::Status::OK;
      }
      response.mutable_chunk()->clear_token_ids();
      response.mutable_chunk()->add_token_ids(100 + i);
      response.mutable_chunk()->set_completion_tokens(i + 1);
      if (!writer->Write(response)) return grpc::Status(grpc::CANCELLED, "client went away");
    }
    response.mutable_complete()->set_finish_reason(v1::FINISH_REASON_LENGTH);
    response.mutable_complete()->mutable_usage()->set_prompt_tokens(request.prompt_token_ids_size());
    response.mutable_complete()->mutable_usage()->set_completion_tokens(tokens);
    writer->Write(response);
    return grpc::Status::OK;
  }

  absl::Mutex mu_;
  Behaviour behaviour_ ABSL_GUARDED_BY(mu_);
  v1::DecodeLoad load_ ABSL_GUARDED_BY(mu_);
  std::vector<SeenRequest> seen_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> aborted_ ABSL_GUARDED_BY(mu_);
  int concurrent_ ABSL_GUARDED_BY(mu_) = 0;
  int max_concurrent_ ABSL_GUARDED_BY(mu_) = 0;
};

class FakePrefillService final : public v1::PrefillService::Service {
 public:
  void SetLoad(v1::PrefillLoad load) {
    absl::MutexLock lock(&mu_);
    load_ = std::move(load);
  }
  grpc::Status GetLoad(grpc::ServerContext*, const v1::GetLoadRequest*,
                       v1::PrefillLoad* response) override {
    absl::MutexLock lock(&mu_);
    *response = load_;
    return grpc::Status::OK;
  }

 private:
  absl::Mutex mu_;
  v1::PrefillLoad load_ ABSL_GUARDED_BY(mu_);
};

// A gRPC server on 127.0.0.1 with a picked port, serving `service` and grpc.health.v1 (SERVING
// for "" and for `service_name`).
class FakeServer {
 public:
  // An empty `service_name` registers no name: health answers only for "" (and NOT_FOUND for
  // the service's name), like a server that never calls SetServingStatus.
  FakeServer(grpc::Service* service, const std::string& service_name) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
    if (!service_name.empty()) {
      server_->GetHealthCheckService()->SetServingStatus(service_name, true);
    }
  }
  ~FakeServer() { Shutdown(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  void SetServing(bool serving) { server_->GetHealthCheckService()->SetServingStatus(serving); }
  // Ends open calls (they fail with UNAVAILABLE/CANCELLED on the client) and stops listening.
  void Shutdown() {
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
      server_->Wait();
      server_.reset();
    }
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace fluxion::cluster::testing

#endif  // FLUXION_CLUSTER_FAKE_DECODE_SERVICE_H_
