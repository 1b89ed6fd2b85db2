#include "cluster/router_service.h"


#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <limits>
#include <optional>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/build_version.h"
#include "glog/logging.h"
#include "cluster/router_policy.h"
#include "cluster/router_validation.h"
#include "common/secret_token.h"
#include "cluster/prefill_pick.h"
#include "common/metrics_names.h"
#include "common/peer_failure.h"

namespace fluxion::cluster {
namespace {

// What a client is told of a decode node's answer `status`: the node's message, never its address
// (an internal detail: it goes to the router's log, where an operator looks for it). A refusal of
// the request itself (invalid, out of range) is the message alone: no node failed.
// The prefill peer's address goes too: in the decode node's report of its failure
// (common/peer_failure.h) and wherever else the text holds one of the two (gRPC's own transport
// errors name the address they could not reach).
std::string DecodeFailure(const std::string& node, const std::string& prefill,
                          const grpc::Status& status) {
  LOG(WARNING) << "decode node " << node << ": " << status.error_message();
  std::string message = status.error_message();
  if (!prefill.empty()) {
    message =
        absl::StrReplaceAll(message, {{PrefillFailureMessage(prefill, ""), "the prefill node: "},
                                      {prefill, "(the prefill node)"}});
  }
  message = absl::StrReplaceAll(message, {{node, "(the decode node)"}});
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
      return message;
    default:
      return absl::StrCat("the decode node: ", message);
  }
}

using SystemClock = std::chrono::system_clock;

bool Retryable(grpc::StatusCode code) {
  // Codes after which another decode node may succeed (docs/PROTOCOL.md, "caller's reaction").
  // OUT_OF_RANGE: the prompt can never fit this node's arena, but may fit a larger one; when no
  // node takes it, the client gets OUT_OF_RANGE (a permanent answer, HTTP 400).
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::RESOURCE_EXHAUSTED ||
         code == grpc::StatusCode::OUT_OF_RANGE || code == grpc::StatusCode::DATA_LOSS ||
         code == grpc::StatusCode::INTERNAL;
}

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}


}  // namespace

// One client Generate call and its downstream attempts. Deleted when the client call is done and
// no attempt is alive (reference count: one for the client call, one per live attempt).
class RouterService::Relay : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  Relay(RouterService* service, grpc::CallbackServerContext* context,
        const v1::GenerateRequest& request)
      : service_(service), context_(context), request_(request), arrival_(SystemClock::now()) {
    deadline_ = context->deadline();
    if (request_.has_timeout_ms()) {
      deadline_ = std::min(deadline_, arrival_ + std::chrono::milliseconds(request_.timeout_ms()));
    }
  }

  // Reads the gateway's prefill pick from the call's metadata (cluster/prefill_pick.h) into
  // gateway_prefill_; INVALID_ARGUMENT when it names none of our prefill nodes, or differs from
  // an explicit prefill_address.
  absl::Status TakeGatewayPrefillPick() {
    const auto& metadata = context_->client_metadata();
    for (const char* header : {kPrefillerHostPortHeader, kPrefillerUrlHeader}) {
      auto it = metadata.find(header);
      if (it == metadata.end()) continue;
      const absl::string_view value(it->second.data(), it->second.size());
      absl::StatusOr<std::string> mapped =
          MapPrefillerPick(header, value, service_->backends_->Snapshot(Role::kPrefill));
      if (!mapped.ok()) return mapped.status();
      if (!pinned_prefill_.empty() && *mapped != pinned_prefill_) {
        return absl::InvalidArgumentError(absl::StrCat(
            header, " names prefill node ", *mapped, " but prefill_address is ", pinned_prefill_,
            "; send one of them"));
      }
      gateway_prefill_ = *mapped;
      return absl::OkStatus();  // x-prefiller-host-port wins over the older x-prefiller-url
    }
    return absl::OkStatus();
  }

  // Whether this attempt goes to the gateway's pick: it is healthy now and no attempt of this
  // request failed on it. Otherwise the router picks by load (the picker's view may be stale).
  bool GatewayPickUsable(const std::vector<BackendState>& prefills) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (gateway_prefill_.empty() || excluded_prefills_.count(gateway_prefill_) > 0) return false;
    for (const BackendState& node : prefills) {
      if (node.address == gateway_prefill_) return node.healthy;
    }
    return false;
  }

  void Begin() {
    if (service_->draining_.load()) {
      FinishOnce(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              absl::StrCat("router ", service_->options_.node_name,
                                           " is draining (shutting down); retry: new connections "
                                           "go to another router")),
                 nullptr);
      return;
    }
    // cluster/router_validation.h; absl and gRPC status codes have the same numbers.
    const absl::Status valid = ValidateRouterRequest(request_);
    if (!valid.ok()) {
      FinishOnce(grpc::Status(static_cast<grpc::StatusCode>(valid.code()),
                              std::string(valid.message())),
                 nullptr);
      return;
    }
    const std::string& id = request_.request_id();
    if (request_.has_prefill_address()) {
      // Never forward a client's choice of the node that gets a decode node's remote key unless
      // it is one of ours (docs/SECURITY.md); a known one pins the request to it.
      bool known = false;
      for (const BackendState& node : service_->backends_->Snapshot(Role::kPrefill)) {
        known = known || node.address == request_.prefill_address();
      }
      if (!known) {
        const std::string& a = request_.prefill_address();
        FinishOnce(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                absl::StrCat("request ", id, ": prefill_address '",
                                             a.size() > 256 ? a.substr(0, 256) + "..." : a,
                                             "' is not one of this router's prefill nodes "
                                             "(--prefill, --prefill-dns); leave it unset and the "
                                             "router picks one")),
                   nullptr);
        return;
      }
      pinned_prefill_ = request_.prefill_address();
    }
    if (absl::Status pick = TakeGatewayPrefillPick(); !pick.ok()) {
      FinishOnce(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              absl::StrCat("request ", id, ": ", pick.message())),
                 nullptr);
      return;
    }
    absl::StatusOr<std::string> token = RandomHexToken(16);
    if (!token.ok()) {
      FinishOnce(grpc::Status(grpc::StatusCode::INTERNAL,
                              absl::StrCat("request ", id, ": ", token.status().message())),
                 nullptr);
      return;
    }
    entry_ = std::make_shared<LiveEntry>();
    entry_->request_id = id;
    entry_->abort_token = *token;
    live_it_ = service_->AddLive(entry_);
    // Accepted: the client gets its abort token before any work (docs/PROTOCOL.md, Abort).
    context_->AddInitialMetadata(kAbortTokenKey, *token);
    StartSendInitialMetadata();
    StartAttempt();
  }

  // The attempt whose message was written cannot have finished meanwhile: its read hold (see
  // Attempt::Start) keeps its call open until this asks for the next message or gives up.
  void OnWriteDone(bool ok) override {
    Attempt* attempt;
    {
      absl::MutexLock lock(&mu_);
      attempt = current_;
    }
    if (ok) {
      attempt->ReadNext();
    } else {
      attempt->StopReading();  // the client is gone; OnCancel follows as well
    }
  }

  void OnCancel() override {
    Attempt* attempt = nullptr;
    bool finish_now = false;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      if (attempt_active_) {
        attempt = current_;
      } else {
        finish_now = true;
      }
    }
    if (attempt != nullptr) attempt->Cancel();
    if (finish_now) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled"), nullptr);
    }
  }

  void OnDone() override {
    service_->metrics_.e2e->Observe(
        std::chrono::duration<double>(SystemClock::now() - arrival_).count());
    service_->CallDone(live_it_);
    Unref();
  }

 private:
  class Attempt : public grpc::ClientReadReactor<v1::GenerateResponse> {
   public:
    Attempt(Relay* relay, std::string decode, std::string prefill)
        : relay_(relay), decode_(std::move(decode)), prefill_(std::move(prefill)) {}
    void Start(v1::DecodeService::Stub* stub, v1::GenerateRequest request,
               std::optional<SystemClock::time_point> deadline) {
      request_ = std::move(request);
      if (deadline.has_value()) context_.set_deadline(*deadline);
      stub->async()->Generate(&context_, &request_, this);
      // The relay asks for the next message from its OnWriteDone, outside this call's reactions.
      // Without a hold the status could arrive between a read and that request, gRPC would
      // finish the call and free its reader, and StartRead would touch freed memory (a rare
      // "pure virtual method called" abort). The hold is released once no read will
      // be asked for from outside: when a read ends the stream, or when the client write failed.
      AddHold();
      StartRead(&response_);
      StartCall();
    }
    void ReadNext() { StartRead(&response_); }
    void Cancel() { context_.TryCancel(); }
    // Called instead of ReadNext when the relay will not read again; nothing may follow.
    void StopReading() {
      Cancel();
      RemoveHold();
    }
    void OnReadInitialMetadataDone(bool ok) override {
      if (!ok) return;
      const auto& metadata = context_.GetServerInitialMetadata();
      auto it = metadata.find(kAbortTokenKey);
      if (it != metadata.end()) {
        relay_->OnDownstreamToken(decode_, std::string(it->second.data(), it->second.size()));
      }
    }
    void OnReadDone(bool ok) override {
      if (ok) {
        relay_->OnAttemptMessage(this);
      } else {
        RemoveHold();
      }
    }
    void OnDone(const grpc::Status& status) override {
      Relay* relay = relay_;
      relay->OnAttemptDone(status);
      relay->Unref();  // may delete the relay and this attempt: nothing may follow
    }
    const std::string& decode() const { return decode_; }
    const std::string& prefill() const { return prefill_; }
    v1::GenerateResponse& response() { return response_; }
    bool saw_message = false;

   private:
    Relay* const relay_;
    const std::string decode_, prefill_;
    grpc::ClientContext context_;
    v1::GenerateRequest request_;
    v1::GenerateResponse response_;
  };

  void Unref() {
    bool last;
    {
      absl::MutexLock lock(&mu_);
      last = --refs_ == 0;
    }
    if (last) delete this;
  }

  // Picks a pair and forwards. Finishes the call instead when no pair is left or time is up.
  void StartAttempt() {
    RouterService* s = service_;
    Attempt* attempt = nullptr;
    v1::GenerateRequest forward;
    std::shared_ptr<v1::DecodeService::Stub> stub;
    std::optional<SystemClock::time_point> deadline;
    grpc::Status fail;
    {
      absl::MutexLock lock(&mu_);
      const std::string& id = request_.request_id();
      auto now = SystemClock::now();
      bool has_deadline = deadline_ != SystemClock::time_point::max();
      if (cancelled_) {
        fail = grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
      } else if (has_deadline && now >= deadline_) {
        fail = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            absl::StrCat("request ", id, ": time budget ran out in the router",
                                         attempts_ > 0 ? absl::StrCat(" after ", attempts_,
                                                                      " failed attempts: ",
                                                                      last_failure_.error_message())
                                                       : ""));
      } else {
        auto decode = PickDecode(s->backends_->Snapshot(Role::kDecode),
                                 request_.prompt_token_ids_size(), s->options_.shed_kv_usage,
                                 excluded_decodes_);
        absl::StatusOr<std::string> prefill = pinned_prefill_;
        if (decode.ok() && pinned_prefill_.empty() && s->backends_->has_prefill_nodes()) {
          std::vector<BackendState> prefills = s->backends_->Snapshot(Role::kPrefill);
          prefill = GatewayPickUsable(prefills) ? absl::StatusOr<std::string>(gateway_prefill_)
                                                : PickPrefill(prefills, excluded_prefills_);
        }
        if (decode.ok() && prefill.ok()) stub = s->backends_->DecodeStub(*decode);
        if (!decode.ok() || !prefill.ok() || stub == nullptr) {
          absl::Status why = !decode.ok()    ? decode.status()
                             : !prefill.ok() ? prefill.status()
                                             : absl::UnavailableError("decode node went away");
          if (why.code() == absl::StatusCode::kResourceExhausted && attempts_ == 0) {
            s->metrics_.shed->Increment();
          }
          if (attempts_ > 0) {
            // The last failure says more than "no node left" does.
            fail = grpc::Status(last_failure_.error_code(),
                                absl::StrCat("request ", id, ": ", attempts_,
                                             " attempts failed before the first token; last: ",
                                             last_failure_.error_message(), " (then: ",
                                             why.message(), ")"));
          } else {
            fail = grpc::Status(static_cast<grpc::StatusCode>(why.code()),
                                absl::StrCat("request ", id, ": ", why.message()));
          }
        } else {
          forward = request_;
          forward.clear_prefill_address();  // only ever one of ours (checked in Begin)
          if (!prefill->empty()) forward.set_prefill_address(*prefill);
          if (has_deadline) {
            // Forward what is left of the budget, so the decode node can end the stream itself
            // with partial usage before the gRPC deadline fires.
            auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - now);
            forward.set_timeout_ms(static_cast<uint32_t>(
                std::clamp<int64_t>(left.count(), 1, std::numeric_limits<uint32_t>::max())));
            // A little later than the budget, so the decode node's own in-stream error (usage,
            // timing) arrives before gRPC's bare DEADLINE_EXCEEDED. The client's deadline still
            // cancels the attempt (OnCancel) when it fires.
            deadline = deadline_ + std::chrono::duration_cast<SystemClock::duration>(
                                       absl::ToChronoNanoseconds(s->options_.deadline_grace));
          }
          ++attempts_;
          attempts_list_.push_back(std::make_unique<Attempt>(this, *decode, *prefill));
          attempt = attempts_list_.back().get();
          current_ = attempt;
          attempt_active_ = true;
          ++refs_;
          s->backends_->NoteDispatch(*decode, request_.prompt_token_ids_size());
          if (!prefill->empty()) s->backends_->NoteDispatch(*prefill, request_.prompt_token_ids_size());
          absl::MutexLock entry_lock(&entry_->mu);
          entry_->decode = *decode;
          entry_->downstream_token.clear();
        }
      }
    }
    if (attempt == nullptr) {
      FinishOnce(fail, nullptr);
      return;
    }
    attempt->Start(stub.get(), std::move(forward), deadline);
  }

  void OnAttemptMessage(Attempt* attempt) {
    bool write = false;
    {
      absl::MutexLock lock(&mu_);
      attempt->saw_message = true;
      v1::GenerateResponse& msg = attempt->response();
      if (msg.has_error() && !relayed_tokens_) {
        // Failed before the first token: hold the error; the request may yet be retried.
        held_error_ = msg;
      } else {
        if (msg.has_chunk() && msg.chunk().token_ids_size() > 0 && !relayed_tokens_) {
          relayed_tokens_ = true;
          service_->metrics_.ttft->Observe(
              std::chrono::duration<double>(SystemClock::now() - arrival_).count());
        }
        out_.Swap(&msg);
        write = true;
      }
    }
    if (write) {
      StartWrite(&out_);  // OnWriteDone asks for the next message
    } else {
      attempt->ReadNext();
    }
  }

  // No client write of this attempt's messages is in flight here: the read hold is released
  // only after the last one completed.
  void OnAttemptDone(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      attempt_active_ = false;
    }
    HandleAttemptDone(status);
  }

  void HandleAttemptDone(const grpc::Status& status) {
    RouterService* s = service_;
    bool retry = false;
    grpc::Status final_status = status;
    const v1::GenerateResponse* final_message = nullptr;
    {
      absl::MutexLock lock(&mu_);
      Attempt* attempt = current_;
      const std::string& id = request_.request_id();
      if (cancelled_) {
        final_status = grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
      } else if (status.ok()) {
        s->metrics_.attempts_ok->Increment();
      } else if (bool aborted = Aborted(); !relayed_tokens_ && aborted) {
        // Aborted through the router while this attempt failed: end as an abort, do not retry.
        final_status = grpc::Status::OK;
        out_.Clear();
        v1::GenerateComplete* done = out_.mutable_complete();
        done->set_finish_reason(v1::FINISH_REASON_ABORT);
        done->mutable_usage()->set_prompt_tokens(request_.prompt_token_ids_size());
        {
          absl::MutexLock entry_lock(&entry_->mu);
          done->set_abort_reason(entry_->abort_reason);
        }
        final_message = &out_;
      } else if (!relayed_tokens_ && Retryable(status.error_code()) &&
                 attempts_ < s->options_.max_attempts) {
        retry = true;
        s->metrics_.attempts_retried->Increment();
        last_failure_ = grpc::Status(status.error_code(),
                                     DecodeFailure(attempt->decode(), attempt->prefill(), status));
        excluded_decodes_.insert(attempt->decode());
        if (!attempt->prefill().empty()) excluded_prefills_.insert(attempt->prefill());
        // No message at all and UNAVAILABLE: the node itself is unreachable, not just busy --
        // unless the decode node answered with its prefill peer's failure (common/peer_failure.h):
        // then the prefill node is what failed, and the decode node stays in for other pairs.
        if (status.error_code() == grpc::StatusCode::UNAVAILABLE && !attempt->saw_message) {
          const bool prefill_failed =
              NamesPrefillFailure(status.error_message(), attempt->prefill());
          s->backends_->MarkFailed(prefill_failed ? attempt->prefill() : attempt->decode(),
                                   status.error_message());
        }
        held_error_.reset();
      } else {
        s->metrics_.attempts_failed->Increment();
        if (relayed_tokens_) {
          final_status = grpc::Status(
              status.error_code(),
              absl::StrCat("request ", id, ": failed after the first token (not retried: "
                           "tokens were already streamed): ",
                           DecodeFailure(attempt->decode(), attempt->prefill(), status)));
        } else {
          final_status = grpc::Status(
              status.error_code(),
              absl::StrCat("request ", id, ": ",
                           DecodeFailure(attempt->decode(), attempt->prefill(), status)));
          if (held_error_.has_value()) {
            out_ = *held_error_;
            final_message = &out_;
          }
        }
      }
    }
    if (retry) {
      StartAttempt();
    } else {
      FinishOnce(final_status, final_message);
    }
  }

  bool Aborted() {
    absl::MutexLock lock(&entry_->mu);
    return entry_->aborted;
  }

  // The attempt on `decode` told its abort token. An Abort that came before it goes out now.
  void OnDownstreamToken(const std::string& decode, const std::string& token) {
    std::string reason;
    {
      absl::MutexLock lock(&entry_->mu);
      if (entry_->decode != decode) return;  // an older attempt's, late
      entry_->downstream_token = token;
      if (!entry_->aborted || entry_->abort_sent_to == token) return;
      entry_->abort_sent_to = token;
      reason = entry_->abort_reason;
    }
    service_->ForwardAbort(decode, {{request_.request_id(), token}}, reason, [] {});
  }

  void FinishOnce(const grpc::Status& status, const v1::GenerateResponse* message) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
    }
    service_->metrics_.registry
        ->AddCounter(metrics::names::kRouterRequestsTotal,
                     "Client Generate calls by final gRPC status.",
                     {{"code", CodeName(status.error_code())}})
        ->Increment();
    if (message != nullptr) {
      StartWriteAndFinish(message, grpc::WriteOptions(), status);
    } else {
      Finish(status);
    }
  }

  RouterService* const service_;
  grpc::CallbackServerContext* const context_;
  const v1::GenerateRequest request_;
  const SystemClock::time_point arrival_;
  SystemClock::time_point deadline_;  // max() when neither a gRPC deadline nor timeout_ms is set
  std::string pinned_prefill_;  // the client's prefill_address, one of ours; "" = the router picks
  // The gateway's pick (x-prefiller-host-port), mapped onto one of ours; "" = none. A preference,
  // not a pin: used while that node is healthy and not yet failed for this request.
  std::string gateway_prefill_;
  // Set in Begin once accepted (before any attempt), then only read.
  std::shared_ptr<LiveEntry> entry_;
  std::optional<LiveMap::iterator> live_it_;

  absl::Mutex mu_;
  int refs_ ABSL_GUARDED_BY(mu_) = 1;
  int attempts_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<Attempt>> attempts_list_ ABSL_GUARDED_BY(mu_);
  Attempt* current_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool attempt_active_ ABSL_GUARDED_BY(mu_) = false;
  bool relayed_tokens_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<v1::GenerateResponse> held_error_ ABSL_GUARDED_BY(mu_);
  grpc::Status last_failure_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> excluded_decodes_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> excluded_prefills_ ABSL_GUARDED_BY(mu_);
  v1::GenerateResponse out_;  // the message being written; touched only with no write in flight
};

RouterService::RouterService(Backends* backends, RouterOptions options,
                             metrics::Registry* registry)
    : backends_(backends), options_(std::move(options)) {
  namespace n = metrics::names;
  metrics_.registry = registry;
  metrics_.inflight = registry->AddGauge(n::kRouterRequestsInflight, "Client Generate calls open.");
  const char* attempts_help =
      "Forwarded Generate attempts by outcome (retried: failed before the first token and tried "
      "on another decode node).";
  metrics_.attempts_ok = registry->AddCounter(n::kRouterAttemptsTotal, attempts_help,
                                              {{"outcome", "ok"}});
  metrics_.attempts_retried = registry->AddCounter(n::kRouterAttemptsTotal, attempts_help,
                                                   {{"outcome", "retried"}});
  metrics_.attempts_failed = registry->AddCounter(n::kRouterAttemptsTotal, attempts_help,
                                                  {{"outcome", "failed"}});
  metrics_.shed = registry->AddCounter(
      n::kRouterShedTotal,
      "Requests refused with RESOURCE_EXHAUSTED because every decode node was above the KV usage "
      "threshold.");
  metrics_.ttft = registry->AddHistogram(n::kRouterTtftSeconds,
                                         "Client arrival to first token relayed.",
                                         metrics::LatencyBuckets());
  metrics_.e2e = registry->AddHistogram(n::kRouterE2eSeconds, "Client arrival to end of stream.",
                                        metrics::LatencyBuckets());
  for (Role role : {Role::kDecode, Role::kPrefill}) {
    registry->AddGaugeCallback(n::kRouterBackendsHealthy, "Backends passing health checks.",
                               {{"role", RoleName(role)}},
                               [backends, role] { return backends->HealthyCount(role); });
  }
}

RouterService::~RouterService() {
  // The registry may outlive us (the process-wide one does): its callbacks must not reach
  // `backends_` any more.
  for (Role role : {Role::kDecode, Role::kPrefill}) {
    metrics_.registry->AddGaugeCallback(metrics::names::kRouterBackendsHealthy,
                                        "Backends passing health checks.",
                                        {{"role", RoleName(role)}}, [] { return 0.0; });
  }
}

grpc::ServerWriteReactor<v1::GenerateResponse>* RouterService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  auto* relay = new Relay(this, context, *request);
  {
    absl::MutexLock lock(&mu_);
    ++open_;
    metrics_.inflight->Set(open_);
  }
  relay->Begin();
  return relay;
}

RouterService::LiveMap::iterator RouterService::AddLive(std::shared_ptr<LiveEntry> entry) {
  absl::MutexLock lock(&mu_);
  const std::string id = entry->request_id;
  return live_.emplace(id, std::move(entry));
}

void RouterService::CallDone(std::optional<LiveMap::iterator> entry) {
  absl::MutexLock lock(&mu_);
  if (entry.has_value()) live_.erase(*entry);
  --open_;
  metrics_.inflight->Set(open_);
}

void RouterService::ForwardAbort(
    const std::string& node, const std::vector<std::pair<std::string, std::string>>& ids_and_tokens,
    const std::string& reason, std::function<void()> done) {
  std::shared_ptr<v1::DecodeService::Stub> stub = backends_->DecodeStub(node);
  if (stub == nullptr) {  // the node left; its requests went with it
    done();
    return;
  }
  struct Call {
    grpc::ClientContext context;
    v1::AbortRequest request;
    v1::AbortResponse response;
    std::function<void()> done;
  };
  auto* call = new Call;
  for (const auto& [id, token] : ids_and_tokens) {
    call->request.add_request_ids(id);
    call->request.add_abort_tokens(token);
  }
  call->request.set_reason(reason);
  call->context.set_deadline(SystemClock::now() + std::chrono::seconds(5));
  call->done = std::move(done);
  // The callback holds the stub: the node may leave the backends meanwhile.
  stub->async()->Abort(&call->context, &call->request, &call->response,
                       [call, stub](grpc::Status) {
                         call->done();
                         delete call;
                       });
}

int RouterService::inflight() const {
  absl::MutexLock lock(&mu_);
  return open_;
}

grpc::ServerUnaryReactor* RouterService::Abort(grpc::CallbackServerContext* context,
                                               const v1::AbortRequest* request,
                                               v1::AbortResponse* response) {
  // An id counts only with the router's abort token for it; anything else is ignored like an
  // unknown id (no oracle). Matches are forwarded to the decode node serving them with that
  // node's token; one whose token has not come yet is aborted when it comes (OnDownstreamToken).
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> by_node;
  {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < request->request_ids_size(); ++i) {
      const std::string& id = request->request_ids(i);
      const std::string token = i < request->abort_tokens_size() ? request->abort_tokens(i) : "";
      bool matched = false;
      for (auto [it, end] = live_.equal_range(id); it != end; ++it) {
        LiveEntry& entry = *it->second;
        if (!TokensEqual(token, entry.abort_token)) continue;
        matched = true;
        MarkAborted(entry, request->reason(), &by_node);
      }
      if (matched) response->add_aborted_request_ids(id);
    }
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (by_node.empty()) {
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  // Answer once every decode node has (or the 5 s deadline passed), as before.
  auto pending = std::make_shared<std::atomic<int>>(static_cast<int>(by_node.size()));
  for (const auto& [node, ids] : by_node) {
    ForwardAbort(node, ids, request->reason(), [reactor, pending] {
      if (--*pending == 0) reactor->Finish(grpc::Status::OK);
    });
  }
  return reactor;
}

void RouterService::MarkAborted(
    LiveEntry& entry, const std::string& reason,
    std::map<std::string, std::vector<std::pair<std::string, std::string>>>* by_node) {
  absl::MutexLock entry_lock(&entry.mu);
  entry.aborted = true;
  entry.abort_reason = reason;
  if (!entry.downstream_token.empty() && entry.abort_sent_to != entry.downstream_token) {
    entry.abort_sent_to = entry.downstream_token;
    (*by_node)[entry.decode].emplace_back(entry.request_id, entry.downstream_token);
  }
}

int RouterService::AbortAll(const std::string& reason) {
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> by_node;
  int aborted = 0;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, entry] : live_) {
      MarkAborted(*entry, reason, &by_node);
      ++aborted;
    }
  }
  for (const auto& [node, ids] : by_node) ForwardAbort(node, ids, reason, [] {});
  return aborted;
}

grpc::ServerUnaryReactor* RouterService::GetLoad(grpc::CallbackServerContext* context,
                                                 const v1::GetLoadRequest*,
                                                 v1::DecodeLoad* response) {
  // Sums over healthy decode nodes (fractions and times averaged), from the last poll: no RPC.
  int healthy = 0;
  double kv_usage = 0, step_ms = 0;
  for (const BackendState& node : backends_->Snapshot(Role::kDecode)) {
    if (!node.healthy) continue;
    const v1::DecodeLoad& l = node.decode_load;
    if (healthy == 0) {
      response->set_page_tokens(l.page_tokens());
      *response->mutable_server()->mutable_layout() = l.server().layout();
      response->mutable_server()->set_max_context_tokens(l.server().max_context_tokens());
    }
    ++healthy;
    response->set_running_requests(response->running_requests() + l.running_requests());
    response->set_prefilling_requests(response->prefilling_requests() + l.prefilling_requests());
    response->set_waiting_requests(response->waiting_requests() + l.waiting_requests());
    response->set_free_kv_pages(response->free_kv_pages() + l.free_kv_pages());
    response->set_total_kv_pages(response->total_kv_pages() + l.total_kv_pages());
    response->set_admittable_prompt_tokens(
        std::max(response->admittable_prompt_tokens(), l.admittable_prompt_tokens()));
    kv_usage += l.kv_usage();
    step_ms += l.recent_step_ms();
  }
  if (healthy > 0) {
    response->set_kv_usage(static_cast<float>(kv_usage / healthy));
    response->set_recent_step_ms(static_cast<float>(step_ms / healthy));
  }
  v1::ServerInfo* server = response->mutable_server();
  server->set_role(v1::SERVER_ROLE_ROUTER);
  server->set_node_name(options_.node_name);
  server->set_protocol_version(v1::PROTOCOL_VERSION_1);
  server->set_build_version(BuildVersion());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace fluxion::cluster
