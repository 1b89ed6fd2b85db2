#include "decode/serving/decode_service.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/secret_token.h"
#include "decode/serving/generate_call.h"

namespace fluxion::decode {
namespace {

namespace v1 = ::fluxion::v1;

std::string IncarnationId() {
  absl::StatusOr<std::string> hex = RandomHexToken(8);
  // Without the kernel's generator (never seen on Linux >= 3.17), the clock still differs per
  // start, which is all uniqueness toward prefill nodes needs.
  return hex.ok() ? *hex : absl::StrCat(absl::ToUnixNanos(absl::Now()));
}


// config.json's EOS ids and generation_config.json's others, once each.
std::vector<int64_t> EosTokenIds(const model::ModelConfig& config,
                                 const DecodeServiceOptions& options) {
  std::vector<int64_t> ids = config.eos_token_ids;
  for (int64_t id : options.extra_eos_token_ids) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  }
  return ids;
}

}  // namespace

DecodeServiceImpl::DecodeServiceImpl(const model::Model* model, KvArena* arena,
                                     KvAdmission* admission, BatchScheduler* scheduler,
                                     transfer::Transport* transport,
                                     const transfer::PeerDescriptor& arena_descriptor,
                                     const v1::ServerInfo& info,
                                     const DecodeServiceOptions& options)
    : model_(model),
      arena_(arena),
      admission_(admission),
      scheduler_(scheduler),
      transport_(transport),
      arena_descriptor_(arena_descriptor),
      info_(info),
      options_(options),
      prefill_client_(options.abort_wait, options.prefill_channel),
      incarnation_(IncarnationId()),
      eos_token_ids_(EosTokenIds(model->config(), options)) {}

grpc::Status DecodeServiceImpl::Generate(grpc::ServerContext* context,
                                         const v1::GenerateRequest* request,
                                         grpc::ServerWriter<v1::GenerateResponse>* writer) {
  grpc::Status status = GenerateCall(context, request, writer);
  if (options_.node_metrics != nullptr) options_.node_metrics->OnRequestDone(status.error_code());
  return status;
}

// The call as its phases (decode/serving/generate_call.h); each may end it, with whatever it wrote
// and counted. The call's pages are held by Reservations, so every ending gives them back.
grpc::Status DecodeServiceImpl::GenerateCall(grpc::ServerContext* context,
                                             const v1::GenerateRequest* request,
                                             grpc::ServerWriter<v1::GenerateResponse>* writer) {
  Call call(this, context, request, writer);
  if (Call::Ending end = call.ParseAndValidate()) return *end;
  if (Call::Ending end = call.Accept()) return *end;
  if (Call::Ending end = call.Admit()) return *end;
  if (Call::Ending end = call.PrefillAndLand()) return *end;
  call.JoinBatch();
  return call.Stream();
}

grpc::Status DecodeServiceImpl::Abort(grpc::ServerContext* context,
                                      const v1::AbortRequest* request,
                                      v1::AbortResponse* response) {
  // An id counts only with its abort token; a wrong or missing token gets the answer an unknown
  // id gets (ignored), so Abort is no oracle for which ids are live (docs/SECURITY.md).
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < request->request_ids_size(); ++i) {
    const std::string& id = request->request_ids(i);
    const std::string token = i < request->abort_tokens_size() ? request->abort_tokens(i) : "";
    bool matched = false;
    for (auto [it, end] = live_.equal_range(id); it != end; ++it) {
      if (!TokensEqual(token, it->second->abort_token)) continue;
      it->second->abort_reason = request->reason();
      it->second->aborted = true;
      matched = true;
    }
    if (matched) response->add_aborted_request_ids(id);
  }
  return grpc::Status::OK;
}

grpc::Status DecodeServiceImpl::GetLoad(grpc::ServerContext* context,
                                        const v1::GetLoadRequest* request,
                                        v1::DecodeLoad* response) {
  const KvArenaCounters c = arena_->counters();
  const model::AttentionShape shape = model_->attention_shape();
  response->set_running_requests(static_cast<uint32_t>(scheduler_->running()));
  response->set_prefilling_requests(static_cast<uint32_t>(prefilling_requests()));
  response->set_waiting_requests(static_cast<uint32_t>(admission_->waiting()));
  response->set_free_kv_pages(c.free);
  response->set_total_kv_pages(c.total);
  response->set_page_tokens(static_cast<uint32_t>(options_.page_tokens));
  response->set_kv_usage(c.total > 0 ? 1.0f - static_cast<float>(c.free) / c.total : 0.0f);
  const int64_t usable = std::max<int64_t>(0, c.free - admission_->headroom_pages());
  response->set_admittable_prompt_tokens(
      static_cast<uint64_t>(usable / (shape.num_layers * shape.num_kv_heads)) *
      options_.page_tokens);
  response->set_recent_step_ms(static_cast<float>(scheduler_->recent_step_ms()));
  response->set_draining(draining_.load());
  *response->mutable_server() = info_;
  return grpc::Status::OK;
}

int64_t DecodeServiceImpl::live_requests() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(live_.size());
}

int64_t DecodeServiceImpl::EndLiveRequests(const std::string& why) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, live] : live_) {
    live->shutdown_reason = why;
    live->shut_down = true;
    live->aborted = true;  // the call's phases watch this one (Cancelled, the stream loop)
  }
  return static_cast<int64_t>(live_.size());
}

int64_t DecodeServiceImpl::prefilling_requests() const {
  absl::MutexLock lock(&mu_);
  int64_t prefilling = 0;
  for (const auto& [id, live] : live_) prefilling += live->prefilling.load() ? 1 : 0;
  return prefilling;
}

DecodeMetrics DecodeServiceImpl::metrics() const {
  DecodeMetrics m;
  {
    absl::MutexLock lock(&mu_);
    m = metrics_;
  }
  m.preempted = scheduler_->preempted();
  m.pages = arena_->counters();
  m.transport = transport_->metrics();
  return m;
}

}  // namespace fluxion::decode
