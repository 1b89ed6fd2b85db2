#include "prefill/prefill_service.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "glog/logging.h"

namespace fluxion::prefill {

namespace v1 = ::fluxion::v1;

PrefillServiceImpl::PrefillServiceImpl(const PrefillEngine* engine,
                                       const transfer::Transport* transport,
                                       const v1::ServerInfo& info, proto::TransferSecret secret,
                                       PrefillNodeMetrics* node_metrics)
    : engine_(engine),
      transport_(transport),
      info_(info),
      secret_(std::move(secret)),
      node_metrics_(node_metrics) {}

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
  // The seal first: nothing in an unproven request (ids, addresses, keys) is looked at further.
  const absl::Time now = absl::Now();
  absl::Status sealed = proto::CheckPrefillSeal(secret_, *request, now);
  if (sealed.ok()) sealed = seen_seals_.Admit(request->seal(), now);
  if (!sealed.ok()) {
    // Every 100th: a flood of forged requests must not flood the log (the per-code request
    // counter of PrefillNodeMetrics counts each one).
    LOG_EVERY_N(WARNING, 100) << "refused a prefill request from " << context->peer() << " ("
                              << google::COUNTER << " so far): " << sealed.message();
    absl::MutexLock lock(&mu_);
    ++metrics_.requests_failed;
    return ToGrpcStatus(sealed);
  }
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
  live->request = request;
  // Cancelled by Abort or by the caller; read by this thread and, inside a batch, its leader.
  live->cancelled = [l = live.get(), context] { return l->aborted.load() || context->IsCancelled(); };
  {
    absl::MutexLock lock(&mu_);
    const int64_t max_queued = max_queued_requests_.load();
    if (max_queued >= 0) {
      int64_t queued = 0;
      for (const auto& [other_id, l] : live_) queued += l->running ? 0 : 1;
      if (queued >= max_queued) {
        ++metrics_.requests_failed;
        return ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
            "prefill queue full: ", queued, " requests already wait on prefill node ",
            info_.node_name(), " (--max-queued-requests ", max_queued,
            "); retry on another prefill node")));
      }
    }
    live->arrival = next_arrival_++;
    if (!live_.emplace(id, live).second) {
      return ToGrpcStatus(absl::AlreadyExistsError(
          absl::StrCat("request '", id, "' is already being prefilled here")));
    }
  }
  // Wait until this request is answered inside another call's batch, or the compute slot is
  // free: then this call leads a batch of itself and the requests queued behind it (arrival
  // order, up to max_batch_tokens prompt tokens: docs/SERVING.md "Batching") and hands each its
  // reply. No waiter starves: each finished batch wakes them all.
  std::vector<std::shared_ptr<Live>> batch;
  // Answered (an error) or handed its Landing by the batch that computed it.
  auto handed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return live->done || live->handed_over;
  };
  {
    absl::MutexLock lock(&mu_);
    while (!handed() && (live->running || (busy_ && !live->cancelled()))) {
      batch_cv_.WaitWithTimeout(&mu_, absl::Milliseconds(20));
    }
    if (!live->running && !busy_ && !live->cancelled()) {
      busy_ = true;
      batch = PickBatchLocked(live);
    }
  }
  if (!batch.empty()) {
    // The batch computes on its own thread, so that this call, like every other in the batch,
    // replies as soon as its own result is in (a request cancelled mid-batch need not wait for
    // the others). Only the holder of busy_ touches batch_thread_: the previous batch's thread
    // has released busy_ and is returning, so the join is immediate.
    if (batch_thread_.joinable()) batch_thread_.join();
    batch_thread_ = std::thread([this, batch] { RunBatch(batch); });
    absl::MutexLock lock(&mu_);
    while (!handed()) batch_cv_.WaitWithTimeout(&mu_, absl::Milliseconds(20));
  }
  std::unique_ptr<PrefillEngine::Landing> landing;
  bool computed;
  {
    absl::MutexLock lock(&mu_);
    computed = handed();
    landing = std::move(live->landing);
  }
  const auto t_start = computed ? live->t_start : std::chrono::steady_clock::now();
  // This call's own writes, waited for on this thread: the compute slot has moved on.
  absl::StatusOr<v1::PrefillResponse> result =
      landing != nullptr ? landing->Wait()
      : computed         ? std::move(live->result)
                         : absl::CancelledError(absl::StrCat("request '", id, "' aborted while queued"));
  landing.reset();
  {
    absl::MutexLock lock(&mu_);
    EraseLocked(live);
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

PrefillServiceImpl::~PrefillServiceImpl() {
  if (batch_thread_.joinable()) batch_thread_.join();
}

void PrefillServiceImpl::RunBatch(const std::vector<std::shared_ptr<Live>>& batch) {
  const auto t_batch = std::chrono::steady_clock::now();
  std::vector<const v1::PrefillRequest*> requests;
  std::vector<std::function<bool()>> cancelled;
  for (const auto& b : batch) {
    b->t_start = t_batch;
    requests.push_back(b->request);
    cancelled.push_back(b->cancelled);
  }
  // Each request's call waits until its `done`, so `requests[i]` and `cancelled[i]` stay valid
  // until its reply is handed over, after which the engine no longer uses them.
  engine_->RunBatchDeferred(
      requests, cancelled, [&](size_t i, std::unique_ptr<PrefillEngine::Landing> landing) {
        absl::MutexLock lock(&mu_);
        // Stays in live_ (running) until its call has waited for the writes: Abort and
        // duplicate ids still find it, GetLoad counts it.
        batch[i]->landing = std::move(landing);
        batch[i]->handed_over = true;
        batch_cv_.SignalAll();
      });
  absl::MutexLock lock(&mu_);
  for (const auto& b : batch) {  // the engine answers each request once; never leave one waiting
    if (!b->done && !b->handed_over) {
      b->result = absl::InternalError("the prefill engine gave this request no reply");
      b->done = true;
      EraseLocked(b);
    }
  }
  busy_ = false;
  if (batch.size() > 1) {
    ++metrics_.batches;
    metrics_.batched_requests += batch.size();
  }
  batch_cv_.SignalAll();
}

void PrefillServiceImpl::EraseLocked(const std::shared_ptr<Live>& live) {
  auto it = live_.find(live->request->request_id());
  if (it != live_.end() && it->second == live) live_.erase(it);
}

std::vector<std::shared_ptr<PrefillServiceImpl::Live>> PrefillServiceImpl::PickBatchLocked(
    const std::shared_ptr<Live>& leader) {
  std::vector<std::shared_ptr<Live>> batch = {leader};
  leader->running = true;
  uint64_t tokens = leader->prompt_tokens;
  if (max_batch_tokens_ <= 0) return batch;
  std::vector<std::shared_ptr<Live>> queued;
  for (const auto& [id, l] : live_) {
    if (l != leader && !l->running && !l->done && l->request != nullptr && !l->cancelled()) {
      queued.push_back(l);
    }
  }
  std::sort(queued.begin(), queued.end(),
            [](const auto& x, const auto& y) { return x->arrival < y->arrival; });
  for (const auto& l : queued) {
    if (tokens + l->prompt_tokens > static_cast<uint64_t>(max_batch_tokens_)) break;
    tokens += l->prompt_tokens;
    l->running = true;
    batch.push_back(l);
  }
  return batch;
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
  m.staging = engine_->staging_stats();
  return m;
}

}  // namespace fluxion::prefill
