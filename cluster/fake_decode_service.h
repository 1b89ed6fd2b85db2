// Test-only fakes of the fluxion.v1 services on real gRPC over loopback: a decode node that streams
// tokens on a fixed timetable (or fails on request), gives each call an abort token and honours
// Abort only with it, as a real one does, and a prefill node that only answers GetLoad.
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
  // When the handler started: later than the client sent the call and than the router forwarded
  // it, so tests bound what was forwarded by causes, not by how fast the machine is.
  std::chrono::system_clock::time_point received;
  bool cancelled = false;
  std::string abort_token;  // what the fake sent in `fluxion-abort-token`
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
    // >= 0: honour timeout_ms like a decode node, noticing it this many ms late (a real one polls
    // every 20 ms): end with `error { DEADLINE_EXCEEDED }` carrying usage and timing.
    int timeout_noticed_late_ms = -1;
  };

  void SetBehaviour(Behaviour b) {
    absl::MutexLock lock(&mu_);
    behaviour_ = std::move(b);
  }
  void SetLoad(v1::DecodeLoad load) {
    absl::MutexLock lock(&mu_);
    load_ = std::move(load);
  }
  // GetLoad answers `status` while it is not OK (a missed check, as a node too busy to answer in
  // time looks to the router's poller); OK restores the normal answer.
  void SetLoadStatus(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    load_status_ = std::move(status);
  }
  std::vector<SeenRequest> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }
  int max_concurrent() {
    absl::MutexLock lock(&mu_);
    return max_concurrent_;
  }
  // GetLoad calls answered so far (a poller's progress).
  int load_calls() {
    absl::MutexLock lock(&mu_);
    return load_calls_;
  }
  // Ids aborted with the right token.
  std::vector<std::string> aborted() {
    absl::MutexLock lock(&mu_);
    return std::vector<std::string>(aborted_.begin(), aborted_.end());
  }
  // Every Abort call's (id, token) pairs, matching or not.
  std::vector<std::pair<std::string, std::string>> abort_calls() {
    absl::MutexLock lock(&mu_);
    return abort_calls_;
  }

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    const auto received = std::chrono::system_clock::now();
    Behaviour b;
    size_t slot;
    {
      absl::MutexLock lock(&mu_);
      b = behaviour_;
      slot = seen_.size();
      seen_.push_back({*request, context->deadline(), received, false,
                       "fake-token-" + request->request_id() + "-" + std::to_string(slot)});
      max_concurrent_ = std::max(max_concurrent_, ++concurrent_);
    }
    grpc::Status status = Serve(context, *request, writer, b, slot);
    absl::MutexLock lock(&mu_);
    --concurrent_;
    seen_[slot].cancelled = context->IsCancelled();
    return status;
  }

  grpc::Status Abort(grpc::ServerContext*, const v1::AbortRequest* request,
                     v1::AbortResponse* response) override {
    // Like a decode node: an id counts only with the token its Generate call was given.
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < request->request_ids_size(); ++i) {
      const std::string& id = request->request_ids(i);
      const std::string token = i < request->abort_tokens_size() ? request->abort_tokens(i) : "";
      abort_calls_.emplace_back(id, token);
      for (const SeenRequest& seen : seen_) {
        if (seen.request.request_id() == id && seen.abort_token == token) {
          aborted_.insert(id);
          aborted_tokens_.insert(token);
          response->add_aborted_request_ids(id);
          break;
        }
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status GetLoad(grpc::ServerContext*, const v1::GetLoadRequest*,
                       v1::DecodeLoad* response) override {
    absl::MutexLock lock(&mu_);
    ++load_calls_;
    if (!load_status_.ok()) return load_status_;
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

  bool IsAborted(size_t slot) {
    absl::MutexLock lock(&mu_);
    return aborted_tokens_.count(seen_[slot].abort_token) > 0;
  }

  grpc::Status Serve(grpc::ServerContext* context, const v1::GenerateRequest& request,
                     grpc::ServerWriter<v1::GenerateResponse>* writer, const Behaviour& b,
                     size_t slot) {
    const auto start = std::chrono::steady_clock::now();
    if (b.reject) {
      grpc::Status s = b.reject(request);
      if (!s.ok()) return s;
    }
    {
      absl::MutexLock lock(&mu_);
      context->AddInitialMetadata("fluxion-abort-token", seen_[slot].abort_token);
    }
    writer->SendInitialMetadata();
    uint32_t tokens = request.sampling().has_max_tokens() ? request.sampling().max_tokens() : 4;
    auto budget_end = std::chrono::steady_clock::time_point::max();
    if (b.timeout_noticed_late_ms >= 0 && request.has_timeout_ms()) {
      budget_end =
          start + std::chrono::milliseconds(request.timeout_ms() + b.timeout_noticed_late_ms);
    }
    v1::GenerateResponse response;
    // Sleeps `d`, or until the budget ends (then false with *timed_out set).
    auto wait = [&](std::chrono::milliseconds d, bool* timed_out) {
      const auto now = std::chrono::steady_clock::now();
      if (budget_end != std::chrono::steady_clock::time_point::max() && now + d >= budget_end) {
        *timed_out = true;
        SleepUnlessCancelled(context, std::chrono::duration_cast<std::chrono::milliseconds>(
                                          budget_end - now));
        return false;
      }
      return SleepUnlessCancelled(context, d);
    };
    auto time_out = [&](uint32_t sent) {
      response.mutable_error()->set_code(grpc::StatusCode::DEADLINE_EXCEEDED);
      response.mutable_error()->set_message("fake decode: ran out of its time budget");
      response.mutable_error()->mutable_usage()->set_prompt_tokens(request.prompt_token_ids_size());
      response.mutable_error()->mutable_usage()->set_completion_tokens(sent);
      response.mutable_error()->mutable_timing()->set_ttft_us(1);
      writer->Write(response);
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "fake decode: time budget");
    };
    bool timed_out = false;
    if (!wait(b.ttft, &timed_out)) {
      if (timed_out && !context->IsCancelled()) return time_out(0);
      return grpc::Status(grpc::CANCELLED, "cancelled");
    }
    for (uint32_t i = 0; i < tokens; ++i) {
      if (i > 0 && !wait(b.itl, &timed_out)) {
        if (timed_out && !context->IsCancelled()) return time_out(i);
        return grpc::Status(grpc::CANCELLED, "cancelled");
      }
      if (b.fail_after_tokens >= 0 && static_cast<int>(i) == b.fail_after_tokens) {
        response.mutable_error()->set_code(b.fail_code);
        response.mutable_error()->set_message("fake decode: injected failure");
        writer->Write(response);
        return grpc::Status(b.fail_code, "fake decode: injected failure");
      }
      bool aborted = IsAborted(slot);
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
  grpc::Status load_status_ ABSL_GUARDED_BY(mu_);
  std::vector<SeenRequest> seen_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> aborted_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> aborted_tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, std::string>> abort_calls_ ABSL_GUARDED_BY(mu_);
  int concurrent_ ABSL_GUARDED_BY(mu_) = 0;
  int max_concurrent_ ABSL_GUARDED_BY(mu_) = 0;
  int load_calls_ ABSL_GUARDED_BY(mu_) = 0;
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
