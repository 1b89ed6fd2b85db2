#include "prefill/prefill_service.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace fluxion::prefill {

namespace v1 = ::fluxion::v1;

PrefillServiceImpl::PrefillServiceImpl(const PrefillEngine* engine,
                                       const transfer::Transport* transport,
                                       const v1::ServerInfo& info,
                                       PrefillNodeMetrics* node_metrics)
    : engine_(engine), transport_(transport), info_(info), node_metrics_(node_metrics) {}

grpc::Status PrefillServiceImpl::Prefill(grpc::ServerContext* context,
                                         const v1::PrefillRequest* request,
                                         v1::PrefillResponse* response) {
  grpc::Status status = PrefillCall(context, request, response);
  if (node_metrics_ != nullptr) node_metrics_->OnRequestDone(status.error_code());
  return status;
}

grpc::Status PrefillServiceImpl::PrefillCall(grpc::ServerContext* context,
                                             const v1::PrefillRequest* request,
                                             v1::PrefillResponse* response) {
  const auto t_arrival = std::chrono::steady_clock::now();
  const std::string& id = request->request_id();
  if (id.empty() || id.size() > 128) {
    return ToGrpcStatus(absl::InvalidArgumentError("request_id must be 1 to 128 bytes"));
  }
  if (draining_.load()) {
    return ToGrpcStatus(absl::UnavailableError(
        absl::StrCat("prefill node ", info_.node_name(), " is draining; retry on another node")));
  }
  auto live = std::make_shared<Live>();
  live->prompt_tokens = request->prompt_token_ids_size();
  {
    absl::MutexLock lock(&mu_);
    if (!live_.emplace(id, live).second) {
      return ToGrpcStatus(absl::AlreadyExistsError(
          absl::StrCat("request '", id, "' is already being prefilled here")));
    }
  }
  auto cancelled = [&] { return live->aborted.load() || context->IsCancelled(); };
  // Wait for the compute slot (arrival order is not guaranteed, but no waiter starves: each
  // finished prompt wakes them all).
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    while (busy_ && !cancelled()) {
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](bool* busy) { return !*busy; }, &busy_),
                           absl::Milliseconds(20));
    }
    if (!busy_) {
      busy_ = true;
      live->running = true;
    }
  }
  const auto t_start = std::chrono::steady_clock::now();
  absl::StatusOr<v1::PrefillResponse> result =
      live->running ? engine_->Run(*request, cancelled)
                    : absl::CancelledError(absl::StrCat("request '", id, "' aborted while queued"));
  {
    absl::MutexLock lock(&mu_);
    if (live->running) busy_ = false;
    live_.erase(id);
    if (result.ok()) {
      ++metrics_.requests_ok;
      metrics_.prompt_tokens += live->prompt_tokens;
    } else if (result.status().code() == absl::StatusCode::kCancelled) {
      ++metrics_.requests_cancelled;
    } else {
      ++metrics_.requests_failed;
    }
  }
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = std::move(*result);
  response->set_node_name(info_.node_name());
  v1::PrefillTiming* timing = response->mutable_timing();
  timing->set_queue_us(
      std::chrono::duration_cast<std::chrono::microseconds>(t_start - t_arrival).count());
  timing->set_total_us(timing->total_us() + timing->queue_us());
  if (node_metrics_ != nullptr) node_metrics_->OnComputed(*timing);
  return grpc::Status::OK;
}

grpc::Status PrefillServiceImpl::Abort(grpc::ServerContext* context,
                                       const v1::AbortRequest* request,
                                       v1::AbortResponse* response) {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : request->request_ids()) {
    auto it = live_.find(id);
    if (it == live_.end()) continue;
    it->second->aborted = true;
    response->add_aborted_request_ids(id);
  }
  return grpc::Status::OK;
}

grpc::Status PrefillServiceImpl::GetLoad(grpc::ServerContext* context,
                                         const v1::GetLoadRequest* request,
                                         v1::PrefillLoad* response) {
  *response = Load();
  return grpc::Status::OK;
}

v1::PrefillLoad PrefillServiceImpl::Load() const {
  v1::PrefillLoad load;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, live] : live_) {
      if (live->running) {
        load.set_running_requests(load.running_requests() + 1);
        load.set_running_prompt_tokens(load.running_prompt_tokens() + live->prompt_tokens);
      } else {
        load.set_queued_requests(load.queued_requests() + 1);
        load.set_queued_prompt_tokens(load.queued_prompt_tokens() + live->prompt_tokens);
      }
    }
  }
  load.set_draining(draining_.load());
  *load.mutable_server() = info_;
  return load;
}

int64_t PrefillServiceImpl::live_requests() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(live_.size());
}

PrefillMetrics PrefillServiceImpl::metrics() const {
  absl::MutexLock lock(&mu_);
  PrefillMetrics m = metrics_;
  m.transport = transport_->metrics();
  return m;
}

}  // namespace fluxion::prefill
