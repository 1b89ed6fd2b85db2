#include "decode/serving/generate_call.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/secret_token.h"
#include "decode/serving/generate_call_steps.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "proto/convert.h"

namespace fluxion::decode {
namespace {

namespace v1 = ::fluxion::v1;
using Clock = std::chrono::steady_clock;

uint64_t MicrosBetween(Clock::time_point a, Clock::time_point b) {
  return b > a ? std::chrono::duration_cast<std::chrono::microseconds>(b - a).count() : 0;
}

v1::FinishReason FinishReasonOf(Finish finish) {
  return finish == Finish::kStop     ? v1::FINISH_REASON_STOP
         : finish == Finish::kLength ? v1::FINISH_REASON_LENGTH
                                     : v1::FINISH_REASON_ABORT;
}

}  // namespace

DecodeServiceImpl::Call::LiveEntry::~LiveEntry() {
  absl::MutexLock lock(&service_->mu_);
  service_->live_.erase(entry_);
}

DecodeServiceImpl::Call::Call(DecodeServiceImpl* service, grpc::ServerContext* context,
                              const v1::GenerateRequest* request,
                              grpc::ServerWriter<v1::GenerateResponse>* writer)
    : service_(service),
      context_(context),
      request_(*request),
      writer_(writer),
      node_metrics_(service->options_.node_metrics),
      t_arrival_(Clock::now()),
      arrival_(absl::Now()),
      prompt_tokens_(request->prompt_token_ids_size()) {}

bool DecodeServiceImpl::Call::Cancelled() const {
  return context_->IsCancelled() || live_->aborted.load();
}

void DecodeServiceImpl::Call::Count(uint64_t DecodeMetrics::*field) {
  absl::MutexLock lock(&service_->mu_);
  ++(service_->metrics_.*field);
}

grpc::Status DecodeServiceImpl::Call::Reject(const absl::Status& status) {
  Count(&DecodeMetrics::rejected);
  return ToGrpcStatus(status);
}

grpc::Status DecodeServiceImpl::Call::Fail(const absl::Status& status) {
  Count(&DecodeMetrics::finished_error);
  return ToGrpcStatus(status);
}

absl::Status DecodeServiceImpl::Call::ShutdownError(uint32_t tokens_sent) const {
  absl::MutexLock lock(&service_->mu_);
  return absl::UnavailableError(absl::StrCat(
      "decode node ", service_->info_.node_name(), " shut down: ", live_->shutdown_reason,
      tokens_sent == 0 ? "; no token was sent, retry on another node"
                       : absl::StrCat(" after ", tokens_sent, " tokens")));
}

grpc::Status DecodeServiceImpl::Call::EndCancelled() {
  Count(&DecodeMetrics::finished_abort);
  if (context_->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  // Ended by the drain before its first token: UNAVAILABLE, which the router retries elsewhere.
  if (live_->shut_down.load()) return ToGrpcStatus(ShutdownError(0));
  v1::GenerateResponse msg;
  v1::GenerateComplete* done = msg.mutable_complete();
  done->set_finish_reason(v1::FINISH_REASON_ABORT);
  *done->mutable_usage() = usage_;
  timing_.set_queue_us(MicrosBetween(t_arrival_, Clock::now()));
  *done->mutable_timing() = timing_;
  done->set_sparse_policy(sparse::PolicyLabel(valid_->policy));
  absl::MutexLock lock(&service_->mu_);
  done->set_abort_reason(live_->abort_reason);
  writer_->WriteLast(msg, grpc::WriteOptions());
  return grpc::Status::OK;
}

DecodeServiceImpl::Call::Ending DecodeServiceImpl::Call::ParseAndValidate() {
  const DecodeServiceOptions& options = service_->options_;
  if (service_->draining_.load()) {
    return Reject(absl::UnavailableError(absl::StrCat(
        "decode node ", service_->info_.node_name(), " is draining; retry on another node")));
  }
  // Everything a client can get wrong is INVALID_ARGUMENT naming the field.
  const model::ModelConfig& config = service_->model_->config();
  absl::StatusOr<ValidatedGenerate> valid = ValidateGenerateRequest(
      request_, GenerateLimits{config.vocab_size,
                               options.context_limit > 0 ? options.context_limit
                                                         : config.max_position_embeddings,
                               options.default_policy, options.default_budget});
  if (!valid.ok()) return Reject(valid.status());
  valid_ = std::move(*valid);
  sparse::PolicyConfig& policy = valid_->policy;
  if (sparse::TraitsOf(policy.kind).uses_predictor) {
    policy.fluxion_predictor = options.fluxion_predictor;
  }
  policy.host_cost = options.host_cost;
  policy.selector = options.selector;
  policy = sparse::WithGuard(policy, options.guard.enabled, options.guard,
                             options.output_projection);
  // The prefill node gets our worker address and remote keys: only a trusted one may be named.
  if (options.prefill_peers == nullptr) {
    return Reject(absl::FailedPreconditionError(
        "no prefill node: start the decode node with --prefill-address (or --prefill-dns)"));
  }
  if (request_.has_prefill_address()) {
    absl::Status trusted = options.prefill_peers->Check(request_.prefill_address());
    if (!trusted.ok()) return Reject(trusted);
    prefill_address_ = request_.prefill_address();
  } else {
    absl::StatusOr<std::string> picked = options.prefill_peers->Pick();
    if (!picked.ok()) return Reject(picked.status());
    prefill_address_ = std::move(*picked);
  }
  return std::nullopt;
}

// Unique per attempt toward the prefill node: a router retrying this id on another decode node
// while the prefill node still holds the first attempt (its decode node died) must not collide
// with it, nor a resumed request's recompute with its first prefill. Starts with the client's id
// for logs; at most 64 + 1 + 16 + 1 + 20 bytes.
std::string DecodeServiceImpl::Call::NextPrefillId() {
  return absl::StrCat(request_.request_id().substr(0, 64), "#", service_->incarnation_, ".",
                      ++service_->prefill_serial_);
}

DecodeServiceImpl::Call::Ending DecodeServiceImpl::Call::Accept() {
  absl::StatusOr<std::string> abort_token = RandomHexToken(16);
  if (!abort_token.ok()) return Reject(abort_token.status());
  const std::string& id = request_.request_id();
  prefill_id_ = NextPrefillId();
  live_ = std::make_shared<Live>();
  live_->abort_token = *std::move(abort_token);
  {
    absl::MutexLock lock(&service_->mu_);
    live_entry_.emplace(service_, service_->live_.emplace(id, live_));
    ++service_->metrics_.requests_started;
  }
  // Accepted: the caller gets the abort token now, before any wait (docs/PROTOCOL.md, Abort).
  context_->AddInitialMetadata(kAbortTokenKey, live_->abort_token);
  writer_->SendInitialMetadata();
  deadline_ = absl::FromChrono(context_->deadline());
  if (request_.has_timeout_ms()) {
    deadline_ = std::min(deadline_, arrival_ + absl::Milliseconds(request_.timeout_ms()));
  }
  usage_.set_prompt_tokens(static_cast<uint32_t>(prompt_tokens_));
  return std::nullopt;
}

DecodeServiceImpl::Call::Ending DecodeServiceImpl::Call::Admit() {
  const model::AttentionShape shape = service_->model_->attention_shape();
  const int64_t pt = service_->options_.page_tokens;
  const size_t page_bytes = service_->arena_->page_bytes();
  pages_per_head_ = (context_tokens_ + pt - 1) / pt;
  const int64_t kv_pages = shape.num_layers * shape.num_kv_heads * pages_per_head_;
  needs_state_ = sparse::TraitsOf(valid_->policy.kind).needs_sparse_state;
  const uint64_t state_bytes =
      SparseStateBytes(shape.num_layers, shape.num_kv_heads, context_tokens_);
  const int64_t state_pages =
      needs_state_ ? static_cast<int64_t>((state_bytes + page_bytes - 1) / page_bytes) : 0;
  // Room for the per-page metadata the prefill node computes (PROTOCOL.md, "Page metadata"):
  // 1/16 of the KV at head_dim 128, held only until landing.
  meta_pages_ = PageMetaRoomPages(shape, pt, context_tokens_, page_bytes);
  absl::StatusOr<Reservation> reserved = service_->admission_->Reserve(
      kv_pages + meta_pages_ + state_pages,
      std::min(deadline_, absl::Now() + service_->options_.admission_timeout),
      [this] { return Cancelled(); });
  if (!reserved.ok()) {
    if (reserved.status().code() == absl::StatusCode::kCancelled) return EndCancelled();
    return Reject(reserved.status());
  }
  t_admitted_ = Clock::now();
  timing_.set_queue_us(MicrosBetween(t_arrival_, t_admitted_));
  {
    absl::MutexLock lock(&service_->mu_);
    // The client's prompt, once: a resumed request's recompute is not a new prompt.
    if (resumes_ == 0) service_->metrics_.prompt_tokens += static_cast<uint64_t>(prompt_tokens_);
  }
  if (node_metrics_ != nullptr) node_metrics_->OnAdmitted(timing_.queue_us() * 1e-6);
  // The prompt's pages and the side room (page metadata, then the sparse state) are owned
  // separately: the room goes back as soon as both are read out. Each run gets its own registration, so the keys sent to the
  // prefill node reach these pages only, and only until the reservation ends (PROTOCOL.md).
  kv_pages_ = std::move(*reserved);
  absl::StatusOr<Reservation> room = kv_pages_.SplitAfter(kv_pages);
  absl::Status registered = room.status();
  if (registered.ok()) {
    state_room_ = std::move(*room);
    registered = kv_pages_.RegisterRuns(service_->transport_);
  }
  if (registered.ok()) registered = state_room_.RegisterRuns(service_->transport_);
  if (!registered.ok()) {
    return Fail(absl::InternalError(absl::StrCat(
        "registering the request's KV pages with the transport: ", registered.message())));
  }
  return std::nullopt;
}

DecodeServiceImpl::Call::Ending DecodeServiceImpl::Call::PrefillAndLand() {
  if (Ending end = Prefill()) return end;
  return Land();
}

DecodeServiceImpl::Call::Ending DecodeServiceImpl::Call::Prefill() {
  const DecodeServiceOptions& options = service_->options_;
  PrefillTarget target;
  target.arena = &service_->arena_descriptor_;
  target.page_bytes = service_->arena_->page_bytes();
  target.kv_pages = &kv_pages_;
  target.state_room = &state_room_;
  target.needs_state = needs_state_;
  target.meta_pages = meta_pages_;
  target.pages_per_head = pages_per_head_;
  target.layout = &service_->info_.layout();
  v1::PrefillRequest prefill =
      BuildPrefillRequest(prefill_id_, *prefill_input_, valid_->sampling, target);
  // min_tokens holds EOS back from the prefill node's draw too (its only use of stop ids).
  v1::SamplingParams* prefill_sampling = prefill.mutable_sampling();
  if (prefill_sampling->min_tokens() > 0 && !prefill_sampling->ignore_eos()) {
    for (int64_t eos : service_->eos_token_ids_) {
      prefill_sampling->add_stop_token_ids(static_cast<uint32_t>(eos));
    }
  }
  const absl::Time prefill_deadline = std::min(deadline_, absl::Now() + options.prefill_timeout);
  if (options.transfer_secret != nullptr) {
    proto::SealPrefillRequest(*options.transfer_secret, prefill_deadline + proto::kSealClockSkew,
                              &prefill);
  }
  // From here until the prefill node's answer, a peer may write into both: if the reservations
  // die first, they are quarantined for the lease (docs/SERVING.md has the rule per ending).
  kv_pages_.SetPeerMayWrite(options.quarantine_lease);
  state_room_.SetPeerMayWrite(options.quarantine_lease);
  live_->prefilling = true;
  PrefillOutcome outcome = service_->prefill_client_.Call(
      prefill_address_, prefill, prefill_deadline,
      [this] { return Cancelled(); });
  live_->prefilling = false;
  t_prefilled_ = Clock::now();
  timing_.set_prefill_us(MicrosBetween(t_admitted_, t_prefilled_));
  if (outcome.peer_stopped) {  // it answered, or never got the request: nobody writes any more
    kv_pages_.SetPeerStopped();
    state_room_.SetPeerStopped();
  }
  if (!outcome.response.ok()) {
    if (!outcome.peer_stopped) {
      Count(&DecodeMetrics::quarantined_reservations);
      if (node_metrics_ != nullptr) node_metrics_->OnQuarantined(WriteHoldName(outcome.hold));
    }
    kv_pages_.Release();  // freed, or quarantined for the lease when a write may be in flight
    state_room_.Release();
    if (outcome.cancelled || (!outcome.expired && Cancelled())) return EndCancelled();
    Count(&DecodeMetrics::finished_error);
    if (node_metrics_ != nullptr) {
      if (outcome.expired) {
        node_metrics_->OnPrefillExpired();
      } else {
        node_metrics_->OnTransferFailed(outcome.response.status().code(), outcome.sent);
      }
    }
    return ToGrpcStatus(outcome.response.status());
  }
  landed_ = *std::move(outcome.response);
  if (node_metrics_ != nullptr) {
    node_metrics_->OnPrefillLanded(
        landed_.kv_bytes_written() + landed_.sparse_state().bytes_written(),
        landed_.timing().transfer_us() * 1e-6);
  }
  timing_.set_transfer_us(landed_.timing().transfer_us());
  timing_.set_prefill_compute_us(landed_.timing().compute_us());
  timing_.set_transfer_tail_us(landed_.timing().transfer_tail_us());
  timing_.set_sparse_state_us(landed_.timing().sparse_state_us());
  return std::nullopt;
}

DecodeServiceImpl::Call::Ending DecodeServiceImpl::Call::Land() {
  LandingInput in;
  in.arena = service_->arena_;
  in.shape = service_->model_->attention_shape();
  in.page_tokens = service_->options_.page_tokens;
  in.prompt_tokens = context_tokens_;
  in.landed = &landed_;
  in.policy = &valid_->policy;
  in.needs_state = needs_state_;
  in.meta_pages = meta_pages_;
  in.pool = service_->options_.cpu_pool;
  absl::StatusOr<PrefillTokens> tokens =
      CheckPrefillTokens(landed_, prefill_input_->sampling(), context_tokens_,
                         service_->model_->config().vocab_size);
  if (!tokens.ok()) {
    kv_pages_.Release();  // the prefill node answered: nobody writes into them any more
    state_room_.Release();
    return Fail(tokens.status());
  }
  prefill_tokens_ = *std::move(tokens);
  bool checksum_failed = false;
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention =
      LandPrompt(in, std::move(kv_pages_), std::move(state_room_), &checksum_failed);
  if (checksum_failed) {
    Count(&DecodeMetrics::checksum_failures);
    if (node_metrics_ != nullptr) node_metrics_->OnChecksumFailure();
  }
  if (!attention.ok()) return Fail(attention.status());  // the pages went back inside LandPrompt
  attention_ = std::move(*attention);
  return std::nullopt;
}

void DecodeServiceImpl::Call::JoinBatch() {
  r_ = NewDecodeRequest(request_, *valid_, service_->eos_token_ids_, ++service_->admission_seq_,
                        std::move(attention_), prompt_tokens_);
  StartDecoding(r_, prefill_tokens_.first_token, prefill_tokens_.first_logprobs,
                service_->scheduler_);
  {
    absl::MutexLock lock(&service_->mu_);
    live_->request = r_;
  }
  timing_.set_load_us(MicrosBetween(t_prefilled_, Clock::now()));
}

grpc::Status DecodeServiceImpl::Call::Stream() {
  Streamed s;
  while (true) {
    StreamTokens(s);
    if (!ShouldResume(s)) return EndStream(s);
    // From here the stream has sent tokens: an ending other than OK is the call's status (the
    // pages went back inside Admit / PrefillAndLand), its usage counting them.
    usage_.set_completion_tokens(s.sent);
    if (Ending end = Resume()) return *end;
    s.finish = Finish::kNone;
  }
}

bool DecodeServiceImpl::Call::ShouldResume(const Streamed& s) {
  // Bounds a request that keeps being preempted: each resume recomputes its whole context.
  constexpr int kMaxResumes = 8;
  if (s.finish != Finish::kError || s.client_gone || s.deadline_hit || resumes_ >= kMaxResumes ||
      generated_.empty() || service_->draining_.load() || Cancelled()) {
    return false;
  }
  absl::MutexLock lock(&r_->mu);
  return r_->preempted && r_->resumable;
}

DecodeServiceImpl::Call::Ending DecodeServiceImpl::Call::Resume() {
  ++resumes_;
  // The KV held the prompt and every generated token but the last, which is the next input.
  resume_request_ = request_;
  // The recompute's first token is not used (the request goes on from its last one), nor are the
  // prompt's logprobs, sent with the first chunk.
  resume_request_.mutable_sampling()->clear_logprobs();
  resume_request_.mutable_sampling()->clear_prompt_logprobs();
  for (size_t i = 0; i + 1 < generated_.size(); ++i) {
    resume_request_.add_prompt_token_ids(static_cast<uint32_t>(generated_[i]));
  }
  prefill_input_ = &resume_request_;
  context_tokens_ = resume_request_.prompt_token_ids_size();
  prefill_id_ = NextPrefillId();
  const v1::GenerateTiming first_run = timing_;
  Ending end = Admit();
  if (!end) end = PrefillAndLand();
  timing_ = first_run;
  if (end) return end;
  std::shared_ptr<DecodeRequest> resumed =
      ResumeDecodeRequest(*r_, std::move(attention_), context_tokens_, service_->scheduler_);
  {
    absl::MutexLock lock(&service_->mu_);
    live_->request = resumed;
    ++service_->metrics_.resumed;
  }
  r_ = std::move(resumed);
  return std::nullopt;
}

void DecodeServiceImpl::Call::StreamTokens(Streamed& s) {
  DecodeRequest& r = *r_;
  while (true) {
    std::vector<int32_t> tokens;
    std::vector<model::TokenLogprobs> logprobs;
    {
      absl::MutexLock lock(&r.mu);
      auto ready = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r.mu) {
        return !r.pending.empty() || r.finish != Finish::kNone;
      };
      r.mu.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(20));
      tokens.swap(r.pending);
      logprobs.swap(r.pending_logprobs);
      s.finish = r.finish;
    }
    if (!tokens.empty() && !s.client_gone) {
      s.sent += static_cast<uint32_t>(tokens.size());
      generated_.insert(generated_.end(), tokens.begin(), tokens.end());
      v1::GenerateResponse msg;
      v1::GenerateChunk* chunk = msg.mutable_chunk();
      for (int32_t t : tokens) chunk->add_token_ids(static_cast<uint32_t>(t));
      chunk->set_completion_tokens(s.sent);
      for (const model::TokenLogprobs& l : logprobs) {
        proto::TokenLogprobsToProto(l, chunk->add_logprobs());
      }
      if (s.sent == tokens.size()) {
        chunk->set_sparse_policy(sparse::PolicyLabel(valid_->policy));
        *chunk->mutable_prompt_logprobs() = std::move(*landed_.mutable_prompt_logprobs());
      }
      const Clock::time_point now = Clock::now();
      if (s.t_first_sent == Clock::time_point{}) {
        s.t_first_sent = now;
        timing_.set_ttft_us(MicrosBetween(t_arrival_, s.t_first_sent));
      } else if (node_metrics_ != nullptr) {
        node_metrics_->OnTokensSent(MicrosBetween(s.t_last_sent, now) * 1e-6,
                                    static_cast<int64_t>(tokens.size()));
      }
      s.t_last_sent = now;
      if (!writer_->Write(msg)) {
        s.client_gone = true;
        r.abort = true;
      }
    }
    if (s.finish != Finish::kNone) return;
    if (context_->IsCancelled()) {
      s.client_gone = true;
      r.abort = true;
    }
    if (live_->aborted.load()) r.abort = true;
    if (!s.deadline_hit && absl::Now() >= deadline_) {
      s.deadline_hit = true;
      r.abort = true;
    }
  }
}

grpc::Status DecodeServiceImpl::Call::EndStream(const Streamed& s) {
  const Clock::time_point t_end = Clock::now();
  usage_.set_completion_tokens(s.sent);
  timing_.set_decode_us(MicrosBetween(s.t_first_sent, t_end));
  if (s.sent > 1) {
    timing_.set_tpot_mean_us(static_cast<double>(timing_.decode_us()) / (s.sent - 1));
  }
  absl::Status error;
  std::optional<int32_t> matched;
  double read_fraction = 1.0;
  bool preempted = false;
  sparse::SelectionStats sparse_stats;
  sparse::GuardStats guard_stats;
  {
    absl::MutexLock lock(&r_->mu);
    timing_.set_tpot_max_us(r_->max_step_us);
    error = r_->error;
    matched = r_->matched_stop;
    read_fraction = r_->read_fraction;
    preempted = r_->preempted;
    sparse_stats = r_->sparse_stats;
    guard_stats = r_->guard_stats;
  }
  {
    absl::MutexLock lock(&service_->mu_);
    DecodeMetrics& m = service_->metrics_;
    m.completion_tokens += s.sent;
    switch (s.finish) {
      case Finish::kStop: ++m.finished_stop; break;
      case Finish::kLength: ++m.finished_length; break;
      case Finish::kAbort: ++m.finished_abort; break;
      default: ++(preempted ? m.finished_preempted : m.finished_error);
    }
  }
  const sparse::PolicyConfig& policy = valid_->policy;
  if (node_metrics_ != nullptr) {
    FinishedRequestStats stats;
    stats.ttft_seconds = s.sent > 0 ? timing_.ttft_us() * 1e-6 : -1;
    stats.e2e_seconds = MicrosBetween(t_arrival_, t_end) * 1e-6;
    stats.prefill_seconds = timing_.prefill_us() * 1e-6;
    if (s.sent > 0) stats.decode_seconds = timing_.decode_us() * 1e-6;
    stats.prompt_tokens = prompt_tokens_;
    stats.completion_tokens = s.sent;
    stats.policy = policy.name;
    stats.read_fraction = read_fraction;
    stats.sparse = sparse_stats;
    stats.guard = std::move(guard_stats);
    node_metrics_->OnFinished(stats);
  }
  if (s.client_gone) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
  v1::GenerateResponse msg;
  const bool shut_down = s.finish == Finish::kAbort && live_->shut_down.load() && !s.deadline_hit;
  if (s.finish == Finish::kError || (s.finish == Finish::kAbort && s.deadline_hit) || shut_down) {
    if (shut_down) {
      error = ShutdownError(s.sent);
    } else if (s.finish == Finish::kAbort) {
      error = absl::DeadlineExceededError(absl::StrCat("request '", request_.request_id(),
                                                       "' ran out of its time budget after ",
                                                       s.sent, " tokens"));
    }
    v1::GenerateError* e = msg.mutable_error();
    e->set_code(static_cast<int32_t>(error.code()));
    e->set_message(std::string(error.message()));
    *e->mutable_usage() = usage_;
    *e->mutable_timing() = timing_;
    writer_->WriteLast(msg, grpc::WriteOptions());
    return ToGrpcStatus(error);
  }
  v1::GenerateComplete* done = msg.mutable_complete();
  done->set_finish_reason(FinishReasonOf(s.finish));
  if (matched.has_value()) done->set_matched_stop_token_id(static_cast<uint32_t>(*matched));
  *done->mutable_usage() = usage_;
  *done->mutable_timing() = timing_;
  done->set_sparse_policy(sparse::PolicyLabel(policy));
  done->set_read_fraction(static_cast<float>(read_fraction));
  if (s.finish == Finish::kAbort) {
    absl::MutexLock lock(&service_->mu_);
    done->set_abort_reason(live_->abort_reason);
  }
  writer_->WriteLast(msg, grpc::WriteOptions());
  return grpc::Status::OK;
}

}  // namespace fluxion::decode
