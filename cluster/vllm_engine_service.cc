#include "cluster/vllm_engine_service.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cluster/prefill_pick.h"
#include "cluster/router_service.h"
#include "cluster/vllm_engine_mapping.h"
#include "model/stream_detokenizer.h"

namespace fluxion::cluster {
namespace {

namespace ve = vllm::grpc::engine;
using SystemClock = std::chrono::system_clock;

// Bound on the in-process calls made for a unary RPC whose caller set no deadline.
constexpr auto kUnaryTimeout = std::chrono::seconds(5);

void SetDeadline(grpc::CallbackServerContext* server, grpc::ClientContext* client,
                 std::optional<SystemClock::duration> fallback) {
  const SystemClock::time_point deadline = server->deadline();
  if (deadline != SystemClock::time_point::max()) {
    client->set_deadline(deadline);
  } else if (fallback.has_value()) {
    client->set_deadline(SystemClock::now() + *fallback);
  }
}

const char* DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return "bfloat16";
    case v1::DTYPE_FP16:
      return "float16";
    case v1::DTYPE_FP32:
      return "float32";
    default:
      return "";
  }
}

}  // namespace

// One VllmEngine Generate call and its in-process fluxion.v1 Generate call. Deleted when both are
// done (reference count: one for the server call, one for the downstream call once started).
// Flow control as in the router's relay: the next downstream message is read only after the
// previous one was written to the client.
class VllmEngineService::GenerateCall : public grpc::ServerWriteReactor<ve::GenerateResponse> {
 public:
  GenerateCall(VllmEngineService* service, grpc::CallbackServerContext* context,
               const ve::GenerateRequest& request)
      : service_(service), context_(context), request_(request), downstream_(this) {}

  void Start() {
    absl::Status valid = ValidateVllmRequest(request_);
    if (!valid.ok()) return FinishWith(valid);
    std::vector<uint32_t> prompt;
    if (request_.has_tokenized()) {
      prompt.assign(request_.tokenized().input_ids().begin(),
                    request_.tokenized().input_ids().end());
    } else {
      if (service_->options_.tokenizer == nullptr) {
        return FinishWith(absl::FailedPreconditionError(absl::StrCat(
            "request ", request_.request_id().substr(0, 128),
            ": text input needs the router's tokenizer: start the router with --model-dir "
            "(a model directory with tokenizer.json), or send tokenized.input_ids")));
      }
      auto ids = service_->options_.tokenizer->Encode(request_.text());
      if (!ids.ok()) {
        return FinishWith(absl::InvalidArgumentError(absl::StrCat(
            "request ", request_.request_id().substr(0, 128), ": text: ", ids.status().message())));
      }
      prompt.assign(ids->begin(), ids->end());  // ids from Encode are never negative
    }
    if (absl::Status s = StartStopStrings(); !s.ok()) return FinishWith(s);
    prompt_tokens_ = static_cast<uint32_t>(prompt.size());
    v1::DecodeService::Stub* stub = service_->stub();
    if (stub == nullptr) {
      return FinishWith(absl::UnavailableError("router starting: VllmEngine not connected yet"));
    }
    service_->AddLive(request_.request_id(), this);
    registered_ = true;
    {
      absl::MutexLock lock(&mu_);
      refs_ = 2;
      started_ = true;
    }
    SetDeadline(context_, &downstream_.context, std::nullopt);
    // The gateway's prefill pick, for the router to honour (cluster/prefill_pick.h).
    for (const char* header : {kPrefillerHostPortHeader, kPrefillerUrlHeader}) {
      auto it = context_->client_metadata().find(header);
      if (it == context_->client_metadata().end()) continue;
      downstream_.context.AddMetadata(header, std::string(it->second.data(), it->second.size()));
    }
    downstream_.request = ToFluxionRequest(request_, prompt);
    stub->async()->Generate(&downstream_.context, &downstream_.request, &downstream_);
    // Held until no read will be asked for from outside the call's reactions (OnWriteDone), so
    // the call cannot finish and free its reader in between (cluster/router_service.cc).
    downstream_.AddHold();
    downstream_.StartRead(&downstream_.response);
    downstream_.StartCall();
  }

  // Abort RPC: ends the request through the router's Abort, now or once its token is known.
  // Returns the token to send with, or "" when there is none yet (or it was sent already).
  std::string RequestAbort() {
    absl::MutexLock lock(&mu_);
    if (abort_requested_) return "";
    abort_requested_ = true;
    if (token_.empty()) return "";
    return token_;
  }

  void OnWriteDone(bool ok) override {
    if (ok) {
      downstream_.StartRead(&downstream_.response);
    } else {
      downstream_.context.TryCancel();  // the client is gone
      downstream_.RemoveHold();
    }
  }

  void OnCancel() override {
    bool started;
    {
      absl::MutexLock lock(&mu_);
      started = started_;
    }
    // Outside the lock: cancelling may run the downstream call's reactions inline.
    if (started) downstream_.context.TryCancel();
  }

  void OnDone() override {
    if (registered_) service_->RemoveLive(request_.request_id(), this);
    Unref();
  }

 private:
  struct Downstream : grpc::ClientReadReactor<v1::GenerateResponse> {
    explicit Downstream(GenerateCall* call) : call(call) {}
    void OnReadInitialMetadataDone(bool ok) override {
      if (!ok) return;
      const auto& metadata = context.GetServerInitialMetadata();
      auto it = metadata.find(RouterService::kAbortTokenKey);
      if (it != metadata.end()) call->OnToken(std::string(it->second.data(), it->second.size()));
    }
    void OnReadDone(bool ok) override {
      if (ok) {
        call->OnMessage();
      } else {
        RemoveHold();
      }
    }
    void OnDone(const grpc::Status& status) override {
      GenerateCall* c = call;
      c->OnDownstreamDone(status);
      c->Unref();  // may delete this: nothing may follow
    }
    GenerateCall* call;
    grpc::ClientContext context;
    v1::GenerateRequest request;
    v1::GenerateResponse response;
  };

  void OnToken(const std::string& token) {
    bool send = false;
    {
      absl::MutexLock lock(&mu_);
      token_ = token;
      send = abort_requested_;  // an Abort came before the token: send it now
    }
    if (send) service_->SendAbort(request_.request_id(), token);
  }

  // One downstream message, read into downstream_.response. Either writes to the client (whose
  // OnWriteDone asks for the next) or asks for the next itself.
  void OnMessage() {
    const v1::GenerateResponse& in = downstream_.response;
    if (in.has_chunk() && stopped_) {
      // Past a stop string: what the router still sends before our Abort lands is dropped.
    } else if (in.has_chunk()) {
      google::protobuf::RepeatedField<uint32_t> ids = in.chunk().token_ids();
      if (detokenizer_.has_value()) CutAtStopString(&ids);
      const bool first = first_chunk_;
      first_chunk_ = false;
      const bool asked_prompt = downstream_.request.sampling().has_prompt_logprobs();
      if (request_.stream()) {
        sent_tokens_ += static_cast<uint32_t>(ids.size());
        last_chunk_.assign(ids.begin(), ids.end());
        out_.Clear();
        ve::GenerateStreamChunk* chunk = out_.mutable_chunk();
        *chunk->mutable_token_ids() = ids;
        chunk->set_prompt_tokens(prompt_tokens_);
        chunk->set_completion_tokens(static_cast<uint32_t>(ids.size()));  // this chunk's
        if (downstream_.request.sampling().has_logprobs()) {
          AppendOutputLogprobs(in.chunk(), ids.size(), chunk->mutable_output_logprobs());
        }
        if (first && asked_prompt) {
          *chunk->mutable_input_logprobs() =
              ToVllmInputLogprobs(downstream_.request.prompt_token_ids(), in.chunk());
        }
        StartWrite(&out_);
        return;
      }
      sent_tokens_ += static_cast<uint32_t>(ids.size());
      all_ids_.insert(all_ids_.end(), ids.begin(), ids.end());
      if (downstream_.request.sampling().has_logprobs()) {
        AppendOutputLogprobs(in.chunk(), ids.size(), &all_logprobs_);
      }
      if (first && asked_prompt) {
        input_logprobs_ = ToVllmInputLogprobs(downstream_.request.prompt_token_ids(), in.chunk());
      }
    } else if (in.has_complete()) {
      complete_ = in.complete();
    }
    // `error`: vLLM's protocol has no in-stream error; the status that follows carries its code.
    downstream_.StartRead(&downstream_.response);
  }

  // Sets up stop-string matching when the request has stop strings (they need the tokenizer).
  absl::Status StartStopStrings() {
    const auto& stop = request_.sampling_params().stop();
    if (stop.empty()) return absl::OkStatus();
    const std::string id = request_.request_id().substr(0, 128);
    if (service_->options_.tokenizer == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("request ", id,
                       ": sampling_params.stop needs the router's tokenizer: start the router "
                       "with --model-dir, or use stop_token_ids"));
    }
    model::StreamDetokenizerOptions options;
    options.skip_special = request_.sampling_params().skip_special_tokens();
    options.stop.assign(stop.begin(), stop.end());
    auto detokenizer = model::StreamDetokenizer::Create(service_->options_.tokenizer, options);
    if (!detokenizer.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", id, ": sampling_params.stop: ", detokenizer.status().message()));
    }
    detokenizer_.emplace(std::move(*detokenizer));
    return absl::OkStatus();
  }

  // Keeps the ids up to the one that completed a stop string (vLLM's rule: the text is cut there,
  // the tokens are not) and, when one did, aborts the rest through the router.
  void CutAtStopString(google::protobuf::RepeatedField<uint32_t>* ids) {
    for (int i = 0; i < ids->size(); ++i) {
      detokenizer_->Add(static_cast<int32_t>(ids->Get(i)));
      if (!detokenizer_->stopped()) continue;
      ids->Truncate(i + 1);
      stopped_ = true;
      std::string token;
      {
        absl::MutexLock lock(&mu_);
        abort_requested_ = true;  // no second Abort from the Abort RPC
        token = token_;
      }
      // The token came in the initial metadata, before any message.
      if (!token.empty()) service_->SendAbort(request_.request_id(), token);
      return;
    }
  }

  void OnDownstreamDone(const grpc::Status& status) {
    if (stopped_) {
      // Whatever ended the router's stream after the stop string (our Abort, or the request's own
      // end), the request stopped at the string.
      out_.Clear();
      ve::GenerateComplete* c = out_.mutable_complete();
      for (uint32_t t : request_.stream() ? last_chunk_ : all_ids_) c->add_output_ids(t);
      c->set_finish_reason("stop");
      c->set_matched_stop_str(*detokenizer_->matched_stop());
      c->set_prompt_tokens(prompt_tokens_);
      c->set_completion_tokens(sent_tokens_);
      AddLogprobs(c);
      StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    if (!status.ok()) {
      Finish(status);
      return;
    }
    if (!complete_.has_value()) {
      Finish(grpc::Status(grpc::StatusCode::INTERNAL,
                          "router stream ended without a terminal message"));
      return;
    }
    out_.Clear();
    *out_.mutable_complete() =
        ToVllmComplete(*complete_, prompt_tokens_, request_.stream() ? last_chunk_ : all_ids_);
    AddLogprobs(out_.mutable_complete());
    StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
  }

  // Not streaming: the whole answer's logprobs in the complete message (streamed chunks carried
  // theirs).
  void AddLogprobs(ve::GenerateComplete* c) {
    if (request_.stream()) return;
    if (downstream_.request.sampling().has_logprobs()) *c->mutable_output_logprobs() = all_logprobs_;
    if (input_logprobs_.has_value()) *c->mutable_input_logprobs() = *input_logprobs_;
  }

  void FinishWith(const absl::Status& status) {
    Finish(
        grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message())));
  }

  void Unref() {
    bool last;
    {
      absl::MutexLock lock(&mu_);
      last = --refs_ == 0;
    }
    if (last) delete this;
  }

  VllmEngineService* const service_;
  grpc::CallbackServerContext* const context_;
  const ve::GenerateRequest request_;
  Downstream downstream_;
  uint32_t prompt_tokens_ = 0;
  bool registered_ = false;  // set before the downstream call starts; read in OnDone
  ve::GenerateResponse out_;
  std::vector<uint32_t> last_chunk_, all_ids_;
  bool first_chunk_ = true;
  ve::OutputLogProbs all_logprobs_;                  // not streaming, with logprobs
  std::optional<ve::InputLogProbs> input_logprobs_;  // not streaming, with prompt_logprobs
  std::optional<v1::GenerateComplete> complete_;
  // Stop strings (sampling_params.stop): matched on the detokenized output.
  std::optional<model::StreamDetokenizer> detokenizer_;
  bool stopped_ = false;  // a stop string completed; later chunks are dropped
  uint32_t sent_tokens_ = 0;
  absl::Mutex mu_;
  int refs_ ABSL_GUARDED_BY(mu_) = 1;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool abort_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::string token_ ABSL_GUARDED_BY(mu_);
};

VllmEngineService::VllmEngineService(VllmEngineOptions options) : options_(std::move(options)) {}
VllmEngineService::~VllmEngineService() = default;

void VllmEngineService::Connect(std::shared_ptr<grpc::Channel> channel) {
  absl::MutexLock lock(&mu_);
  stub_ = v1::DecodeService::NewStub(channel);
  channel_ = std::move(channel);
}

v1::DecodeService::Stub* VllmEngineService::stub() const {
  absl::MutexLock lock(&mu_);
  return stub_.get();
}

int VllmEngineService::open_calls() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(live_.size());
}

void VllmEngineService::AddLive(const std::string& id, GenerateCall* call) {
  absl::MutexLock lock(&mu_);
  live_.emplace(id, call);
  last_receive_ = absl::Now();
}

void VllmEngineService::RemoveLive(const std::string& id, GenerateCall* call) {
  absl::MutexLock lock(&mu_);
  auto [begin, end] = live_.equal_range(id);
  for (auto it = begin; it != end; ++it) {
    if (it->second == call) {
      live_.erase(it);
      return;
    }
  }
}

void VllmEngineService::SendAbort(const std::string& request_id, const std::string& token) {
  v1::DecodeService::Stub* s = stub();
  if (s == nullptr) return;
  struct Call {
    grpc::ClientContext context;
    v1::AbortRequest request;
    v1::AbortResponse response;
  };
  auto* call = new Call;
  call->context.set_deadline(SystemClock::now() + kUnaryTimeout);
  call->request.add_request_ids(request_id);
  call->request.add_abort_tokens(token);
  call->request.set_reason("aborted through VllmEngine.Abort");
  s->async()->Abort(&call->context, &call->request, &call->response,
                    [call](grpc::Status) { delete call; });
}

void VllmEngineService::FetchLoad(
    grpc::CallbackServerContext* context,
    std::function<void(const grpc::Status&, const v1::DecodeLoad&)> done) {
  v1::DecodeService::Stub* s = stub();
  if (s == nullptr) {
    done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "router starting"), v1::DecodeLoad());
    return;
  }
  struct Call {
    grpc::ClientContext context;
    v1::GetLoadRequest request;
    v1::DecodeLoad response;
  };
  auto* call = new Call;
  SetDeadline(context, &call->context, kUnaryTimeout);
  s->async()->GetLoad(&call->context, &call->request, &call->response,
                      [call, done = std::move(done)](grpc::Status status) {
                        done(status, call->response);
                        delete call;
                      });
}

grpc::ServerWriteReactor<ve::GenerateResponse>* VllmEngineService::Generate(
    grpc::CallbackServerContext* context, const ve::GenerateRequest* request) {
  auto* call = new GenerateCall(this, context, *request);
  call->Start();
  return call;
}

grpc::ServerUnaryReactor* VllmEngineService::HealthCheck(grpc::CallbackServerContext* context,
                                                         const ve::HealthCheckRequest*,
                                                         ve::HealthCheckResponse* response) {
  const bool healthy = options_.healthy && options_.healthy();
  response->set_healthy(healthy);
  response->set_message(healthy ? "serving" : "no healthy decode node");
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* VllmEngineService::Abort(grpc::CallbackServerContext* context,
                                                   const ve::AbortRequest* request,
                                                   ve::AbortResponse*) {
  std::vector<std::pair<std::string, std::string>> to_send;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : request->request_ids()) {
      auto [begin, end] = live_.equal_range(id);
      for (auto it = begin; it != end; ++it) {
        std::string token = it->second->RequestAbort();
        if (!token.empty()) to_send.emplace_back(id, std::move(token));
      }
    }
  }
  for (const auto& [id, token] : to_send) SendAbort(id, token);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);  // asynchronous, as vLLM's: the stream ends with "abort"
  return reactor;
}

grpc::ServerUnaryReactor* VllmEngineService::GetLoads(grpc::CallbackServerContext* context,
                                                      const ve::GetLoadsRequest* request,
                                                      ve::GetLoadsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (request->has_dp_rank() && request->dp_rank() != 0) {
    reactor->Finish(grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("dp_rank ", request->dp_rank(), ": the router is one data-parallel rank, 0")));
    return reactor;
  }
  FetchLoad(context, [reactor, response](const grpc::Status& status, const v1::DecodeLoad& load) {
    if (status.ok()) *response = ToVllmLoads(load, absl::Now());
    reactor->Finish(status);
  });
  return reactor;
}

grpc::ServerUnaryReactor* VllmEngineService::GetModelInfo(grpc::CallbackServerContext* context,
                                                          const ve::GetModelInfoRequest*,
                                                          ve::GetModelInfoResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  FetchLoad(
      context, [this, reactor, response](const grpc::Status& status, const v1::DecodeLoad& load) {
        if (!status.ok()) {
          reactor->Finish(status);
          return;
        }
        const v1::ServerInfo& server = load.server();
        response->set_model_path(options_.model_dir.empty() ? server.layout().model_id()
                                                            : options_.model_dir);
        response->set_served_model_name(options_.served_model_name.empty()
                                            ? server.layout().model_id()
                                            : options_.served_model_name);
        response->set_is_generation(true);
        response->set_max_context_length(server.max_context_tokens());
        // A prompt must leave room for at least one generated token (docs/PROTOCOL.md).
        response->set_max_req_input_len(
            static_cast<int32_t>(std::max<uint32_t>(server.max_context_tokens(), 1) - 1));
        if (options_.tokenizer != nullptr) {
          response->set_tokenizer_path(options_.model_dir);
          response->set_vocab_size(static_cast<uint32_t>(options_.tokenizer->vocab_size()));
        }
        if (options_.config.has_value()) {
          const model::ModelConfig& c = *options_.config;
          response->set_model_type(model::ModelTypeName(c.architecture));
          response->add_architectures(model::ArchitectureName(c.architecture));
          if (options_.tokenizer == nullptr)
            response->set_vocab_size(static_cast<uint32_t>(c.vocab_size));
          for (int64_t id : c.eos_token_ids) response->add_eos_token_ids(static_cast<int32_t>(id));
          response->set_bos_token_id(static_cast<int32_t>(std::max<int64_t>(c.bos_token_id, 0)));
          if (c.pad_token_id >= 0) response->set_pad_token_id(static_cast<int32_t>(c.pad_token_id));
        }
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

grpc::ServerUnaryReactor* VllmEngineService::GetServerInfo(grpc::CallbackServerContext* context,
                                                           const ve::GetServerInfoRequest*,
                                                           ve::GetServerInfoResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  FetchLoad(context,
            [this, reactor, response](const grpc::Status& status, const v1::DecodeLoad& load) {
              if (!status.ok()) {
                reactor->Finish(status);
                return;
              }
              response->set_active_requests(load.running_requests() + load.prefilling_requests() +
                                            load.waiting_requests());
              response->set_is_paused(load.draining());
              {
                absl::MutexLock lock(&mu_);
                response->set_last_receive_timestamp(
                    absl::ToDoubleSeconds(last_receive_ - absl::UnixEpoch()));
              }
              response->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - start_));
              response->set_server_type("fluxion-router");
              // The router pairs prefill and decode nodes itself: to a gateway it is one whole
              // engine.
              response->set_data_parallel_size(1);
              response->set_kv_cache_dtype(DTypeName(load.server().layout().kv_dtype()));
              response->set_block_size(static_cast<int32_t>(load.page_tokens()));
              if (options_.config.has_value())
                response->set_model_dtype(options_.config->torch_dtype);
              reactor->Finish(grpc::Status::OK);
            });
  return reactor;
}

}  // namespace fluxion::cluster
