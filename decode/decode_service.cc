#include "decode/decode_service.h"


#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/secret_token.h"
#include "common/grpc_status.h"
#include "decode/generate_validation.h"
#include "decode/paged_kv.h"
#include "decode/sparse/policy.h"
#include "decode/sparse_attention.h"
#include "model/sparse_state.h"
#include "proto/convert.h"
#include "transfer/crc32c.h"

namespace fluxion::decode {
namespace {

namespace v1 = ::fluxion::v1;
using Clock = std::chrono::steady_clock;

uint64_t MicrosBetween(Clock::time_point a, Clock::time_point b) {
  return b > a ? std::chrono::duration_cast<std::chrono::microseconds>(b - a).count() : 0;
}

uint64_t SparseStateBytes(int64_t layers, int64_t heads, int64_t tokens) {
  return 72 + static_cast<uint64_t>(layers * heads) * (20 + 8 * static_cast<uint64_t>(tokens));
}

std::string IncarnationId() {
  absl::StatusOr<std::string> hex = RandomHexToken(8);
  // Without the kernel's generator (never seen on Linux >= 3.17), the clock still differs per
  // start, which is all uniqueness toward prefill nodes needs.
  return hex.ok() ? *hex : absl::StrCat(absl::ToUnixNanos(absl::Now()));
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
      incarnation_(IncarnationId()) {}

grpc::Status DecodeServiceImpl::Generate(grpc::ServerContext* context,
                                         const v1::GenerateRequest* request,
                                         grpc::ServerWriter<v1::GenerateResponse>* writer) {
  grpc::Status status = GenerateCall(context, request, writer);
  if (options_.node_metrics != nullptr) options_.node_metrics->OnRequestDone(status.error_code());
  return status;
}

grpc::Status DecodeServiceImpl::GenerateCall(grpc::ServerContext* context,
                                             const v1::GenerateRequest* request,
                                             grpc::ServerWriter<v1::GenerateResponse>* writer) {
  DecodeNodeMetrics* const node_metrics = options_.node_metrics;
  const Clock::time_point t_arrival = Clock::now();
  const absl::Time arrival = absl::Now();
  const model::ModelConfig& config = model_->config();
  const model::AttentionShape shape = model_->attention_shape();
  const int64_t n = request->prompt_token_ids_size();
  auto reject = [this](absl::Status s) {
    absl::MutexLock lock(&mu_);
    ++metrics_.rejected;
    return ToGrpcStatus(s);
  };

  if (draining_.load()) {
    return reject(absl::UnavailableError(
        absl::StrCat("decode node ", info_.node_name(), " is draining; retry on another node")));
  }
  // 1. Validate: everything a client can get wrong is INVALID_ARGUMENT naming the field
  // (decode/generate_validation.h).
  const int64_t context_limit = config.max_position_embeddings;
  absl::StatusOr<ValidatedGenerate> valid = ValidateGenerateRequest(
      *request, GenerateLimits{config.vocab_size, context_limit, options_.default_policy,
                               options_.default_budget});
  if (!valid.ok()) return reject(valid.status());
  const std::string& id = request->request_id();
  const v1::SamplingParams& sp = request->sampling();
  const model::SamplingParams* const sampling = &valid->sampling;
  const int64_t max_tokens = valid->max_tokens;
  const std::string& policy_name = valid->policy_name;
  sparse::PolicyConfig* const policy = &valid->policy;
  if (sparse::TraitsOf(policy->kind).uses_predictor) {
    policy->fluxion_predictor = options_.fluxion_predictor;
  }
  policy->host_cost = options_.host_cost;
  // The prefill node gets our worker address and remote key: only a trusted one may be named.
  if (options_.prefill_peers == nullptr) {
    return reject(absl::FailedPreconditionError(
        "no prefill node: start the decode node with --prefill-address (or --prefill-dns)"));
  }
  absl::StatusOr<std::string> prefill_address = request->prefill_address();
  if (request->has_prefill_address()) {
    absl::Status trusted = options_.prefill_peers->Check(request->prefill_address());
    if (!trusted.ok()) return reject(trusted);
  } else {
    prefill_address = options_.prefill_peers->Pick();
    if (!prefill_address.ok()) return reject(prefill_address.status());
  }
  absl::StatusOr<std::string> abort_token = RandomHexToken(16);
  if (!abort_token.ok()) return reject(abort_token.status());
  // Unique per attempt toward the prefill node: a router retrying this id on another decode node
  // while the prefill node still holds the first attempt (its decode node died) must not collide
  // with it. Starts with the client's id for logs; at most 64 + 1 + 16 + 1 + 20 bytes.
  const std::string prefill_id = absl::StrCat(id.substr(0, 64), "#", incarnation_, ".",
                                              ++prefill_serial_);

  auto live = std::make_shared<Live>();
  live->abort_token = *abort_token;
  std::multimap<std::string, std::shared_ptr<Live>>::iterator live_entry;
  {
    absl::MutexLock lock(&mu_);
    live_entry = live_.emplace(id, live);
    ++metrics_.requests_started;
  }
  struct Unregister {
    DecodeServiceImpl* self;
    std::multimap<std::string, std::shared_ptr<Live>>::iterator entry;
    ~Unregister() {
      absl::MutexLock lock(&self->mu_);
      self->live_.erase(entry);
    }
  } unregister{this, live_entry};
  // Accepted: the caller gets the abort token now, before any wait (docs/PROTOCOL.md, Abort).
  context->AddInitialMetadata(kAbortTokenKey, live->abort_token);
  writer->SendInitialMetadata();

  absl::Time deadline = absl::FromChrono(context->deadline());
  if (request->has_timeout_ms()) {
    deadline = std::min(deadline, arrival + absl::Milliseconds(request->timeout_ms()));
  }
  auto cancelled = [&] { return context->IsCancelled() || live->aborted.load(); };
  v1::Usage usage;
  usage.set_prompt_tokens(static_cast<uint32_t>(n));
  v1::GenerateTiming timing;
  auto count = [this](uint64_t DecodeMetrics::*field) {
    absl::MutexLock lock(&mu_);
    ++(metrics_.*field);
  };
  // Ends a request cancelled before it joined the batch.
  auto end_cancelled = [&]() -> grpc::Status {
    count(&DecodeMetrics::finished_abort);
    if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    v1::GenerateResponse msg;
    v1::GenerateComplete* done = msg.mutable_complete();
    done->set_finish_reason(v1::FINISH_REASON_ABORT);
    *done->mutable_usage() = usage;
    timing.set_queue_us(MicrosBetween(t_arrival, Clock::now()));
    *done->mutable_timing() = timing;
    done->set_sparse_policy(sparse::PolicyLabel(*policy));
    absl::MutexLock lock(&mu_);
    done->set_abort_reason(live->abort_reason);
    writer->WriteLast(msg, grpc::WriteOptions());
    return grpc::Status::OK;
  };

  // 2. Admission: pages for every layer and KV head of the prompt, plus room for the sparse state.
  const int64_t pt = options_.page_tokens;
  const int64_t per_head = (n + pt - 1) / pt;
  const int64_t kv_pages = shape.num_layers * shape.num_kv_heads * per_head;
  const bool needs_state = sparse::TraitsOf(policy->kind).needs_sparse_state;
  const uint64_t state_bytes = SparseStateBytes(shape.num_layers, shape.num_kv_heads, n);
  const int64_t state_pages =
      needs_state ? static_cast<int64_t>((state_bytes + arena_->page_bytes() - 1) /
                                         arena_->page_bytes())
                  : 0;
  absl::StatusOr<Reservation> reserved = admission_->Reserve(
      kv_pages + state_pages, std::min(deadline, absl::Now() + options_.admission_timeout),
      cancelled);
  if (!reserved.ok()) {
    if (reserved.status().code() == absl::StatusCode::kCancelled) return end_cancelled();
    return reject(reserved.status());
  }
  const Clock::time_point t_admitted = Clock::now();
  timing.set_queue_us(MicrosBetween(t_arrival, t_admitted));
  {
    absl::MutexLock lock(&mu_);
    metrics_.prompt_tokens += static_cast<uint64_t>(n);
  }
  if (node_metrics != nullptr) node_metrics->OnAdmitted(timing.queue_us() * 1e-6);
  // The prompt's pages and the sparse-state room are owned separately: the room goes back as
  // soon as the state is parsed. Each run gets its own registration, so the keys sent to the
  // prefill node reach these pages only, and only until the reservation ends (PROTOCOL.md).
  Reservation kv_pages_held = std::move(*reserved);
  absl::StatusOr<Reservation> state_held = kv_pages_held.SplitAfter(kv_pages);
  absl::Status registered = state_held.status();
  if (registered.ok()) registered = kv_pages_held.RegisterRuns(transport_);
  if (registered.ok()) registered = state_held->RegisterRuns(transport_);
  if (!registered.ok()) {
    count(&DecodeMetrics::finished_error);
    return ToGrpcStatus(absl::InternalError(absl::StrCat(
        "registering the request's KV pages with the transport: ", registered.message())));
  }
  const std::vector<PageRun> kv_runs = kv_pages_held.runs();
  const std::vector<PageRun> state_runs = state_held->runs();

  // 3. Prefill: the prefill node writes the KV into kv_runs and the state into state_runs.
  v1::PrefillRequest prefill;
  prefill.set_request_id(prefill_id);
  *prefill.mutable_prompt_token_ids() = request->prompt_token_ids();
  *prefill.mutable_sampling() = request->sampling();
  if (!sp.has_seed()) prefill.mutable_sampling()->set_seed(sampling->seed);
  v1::KvTarget* kv = prefill.mutable_kv_target();
  kv->set_transport(arena_descriptor_.transport);
  kv->set_peer_name(arena_descriptor_.peer_name);
  kv->set_worker_address(arena_descriptor_.worker_address);
  // No arena-wide key: one key per registered run of this reservation (KvTarget.ranges).
  for (const Reservation* held : {&kv_pages_held, &*state_held}) {
    for (const transfer::PeerDescriptor& d : held->ranges()) {
      v1::RemoteRange* range = kv->add_ranges();
      range->set_base_address(d.base_address);
      range->set_length(d.length);
      range->set_remote_key(d.remote_key);
    }
  }
  kv->set_arena_base_address(arena_descriptor_.base_address);
  kv->set_arena_bytes(arena_descriptor_.length);
  kv->set_page_bytes(arena_->page_bytes());
  for (const PageRun& r : kv_runs) {
    v1::PageExtent* e = kv->add_extents();
    e->set_first_page_id(r.first);
    e->set_count(r.count);
  }
  kv->set_page_order(v1::PAGE_ORDER_LAYER_HEAD_PAGE);
  kv->set_pages_per_head(static_cast<uint32_t>(per_head));
  kv->set_checksum_algorithm(v1::CHECKSUM_ALGORITHM_CRC32C);
  if (needs_state) {
    v1::SparseStateTarget* st = prefill.mutable_sparse_target();
    st->set_format_version(model::kSparseStateVersion);
    st->set_base_address(arena_descriptor_.base_address);
    for (const PageRun& r : state_runs) {
      v1::ByteExtent* e = st->add_extents();
      e->set_offset(static_cast<uint64_t>(r.first) * arena_->page_bytes());
      e->set_length(static_cast<uint64_t>(r.count) * arena_->page_bytes());
    }
    st->set_observation_window_tokens(32);
    st->set_score_block_tokens(1);
  }
  *prefill.mutable_layout() = info_.layout();
  prefill.set_protocol_version(1);
  // From here until the prefill node's answer, a peer may write into both: if the reservations
  // die first, they are quarantined for the lease (docs/SERVING.md has the rule per ending).
  kv_pages_held.SetPeerMayWrite(options_.quarantine_lease);
  state_held->SetPeerMayWrite(options_.quarantine_lease);
  live->prefilling = true;
  PrefillOutcome outcome = prefill_client_.Call(
      *prefill_address, prefill, std::min(deadline, absl::Now() + options_.prefill_timeout),
      cancelled);
  live->prefilling = false;
  const Clock::time_point t_prefilled = Clock::now();
  timing.set_prefill_us(MicrosBetween(t_admitted, t_prefilled));
  if (outcome.peer_stopped) {  // it answered, or never got the request: nobody writes any more
    kv_pages_held.SetPeerStopped();
    state_held->SetPeerStopped();
  }
  if (!outcome.response.ok()) {
    if (!outcome.peer_stopped) {
      count(&DecodeMetrics::quarantined_reservations);
      if (node_metrics != nullptr) node_metrics->OnQuarantined(WriteHoldName(outcome.hold));
    }
    kv_pages_held.Release();  // freed, or quarantined for the lease when a write may be in flight
    state_held->Release();
    if (outcome.cancelled || (!outcome.expired && cancelled())) return end_cancelled();
    count(&DecodeMetrics::finished_error);
    if (node_metrics != nullptr) {
      if (outcome.expired) {
        node_metrics->OnPrefillExpired();
      } else {
        node_metrics->OnTransferFailed(outcome.response.status().code(), outcome.sent);
      }
    }
    return ToGrpcStatus(outcome.response.status());
  }
  const v1::PrefillResponse& landed = *outcome.response;
  if (node_metrics != nullptr) {
    node_metrics->OnPrefillLanded(landed.kv_bytes_written() + landed.sparse_state().bytes_written(),
                                  landed.timing().transfer_us() * 1e-6);
  }
  timing.set_transfer_us(landed.timing().transfer_us());
  timing.set_prefill_compute_us(landed.timing().compute_us());
  timing.set_transfer_tail_us(landed.timing().transfer_tail_us());
  timing.set_sparse_state_us(landed.timing().sparse_state_us());

  // 4. Verify what landed, then hand the pages to the request's attention.
  std::vector<int32_t> page_ids;
  page_ids.reserve(kv_pages);
  for (const PageRun& r : kv_runs) {
    for (int32_t p = r.first; p < r.first + r.count; ++p) page_ids.push_back(p);
  }
  auto fail = [&](absl::Status s) -> grpc::Status {
    count(&DecodeMetrics::finished_error);
    return ToGrpcStatus(s);
  };
  const size_t content = KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, pt}.page_bytes();
  if (landed.layer_checksums_size() != shape.num_layers) {
    return fail(absl::DataLossError(absl::StrCat("prefill node ", landed.node_name(), " sent ",
                                                 landed.layer_checksums_size(),
                                                 " layer checksums for ", shape.num_layers,
                                                 " layers")));
  }
  const int64_t ppl = shape.num_kv_heads * per_head;
  for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
    uint32_t crc = 0;
    for (int64_t i = layer * ppl; i < (layer + 1) * ppl; ++i) {
      crc = transfer::Crc32cExtend(crc, arena_->page(page_ids[i]), content);
    }
    if (crc != landed.layer_checksums(layer)) {
      count(&DecodeMetrics::checksum_failures);
      if (node_metrics != nullptr) node_metrics->OnChecksumFailure();
      return fail(absl::DataLossError(absl::StrFormat(
          "KV of layer %d landed with CRC-32C %08x but prefill node %s sent %08x; the request "
          "was not decoded (retry it)",
          layer, crc, landed.node_name(), static_cast<uint32_t>(landed.layer_checksums(layer)))));
    }
  }
  model::SparseState state;
  if (needs_state) {
    const uint64_t written = landed.sparse_state().bytes_written();
    std::string blob;
    for (const PageRun& r : state_runs) {
      if (blob.size() >= written) break;
      const uint64_t len = std::min<uint64_t>(written - blob.size(),
                                              static_cast<uint64_t>(r.count) * arena_->page_bytes());
      blob.append(reinterpret_cast<const char*>(arena_->page(r.first)), len);
    }
    absl::Status ok = absl::OkStatus();
    if (blob.size() != written) {
      ok = absl::DataLossError(absl::StrCat("sparse state of ", written,
                                            " bytes does not fit the reserved room"));
    } else if (transfer::Crc32c(blob.data(), blob.size()) != landed.sparse_state().checksum()) {
      count(&DecodeMetrics::checksum_failures);
      if (node_metrics != nullptr) node_metrics->OnChecksumFailure();
      ok = absl::DataLossError("sparse state landed with a wrong CRC-32C; retry the request");
    } else {
      absl::StatusOr<model::SparseState> parsed = model::SparseState::Parse(blob);
      // Parse checks the state against its own header only; the policy indexes it by this
      // model's shape, so a state for another shape or prompt length must not get through.
      absl::Status matches = parsed.ok() ? parsed->CheckMatches(shape, n) : parsed.status();
      if (matches.ok()) {
        state = std::move(*parsed);
      } else {
        ok = absl::DataLossError(absl::StrCat("sparse state: ", matches.message()));
      }
    }
    if (!ok.ok()) return fail(ok);  // both reservations die with the call: pages freed
  }
  state_held->Release();  // parsed; the room is no longer needed
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, pt};
  absl::StatusOr<std::unique_ptr<PagedKv>> paged =
      PagedKv::Adopt(std::move(kv_pages_held), kv_shape, page_ids, n);  // owns the pages now
  if (!paged.ok()) {
    return fail(absl::InternalError(absl::StrCat("adopting pages: ", paged.status().message())));
  }
  absl::StatusOr<std::unique_ptr<SparseAttention>> attention = SparseAttention::FromPages(
      std::move(*paged), shape, *policy, needs_state ? &state : nullptr);
  if (!attention.ok()) {
    return fail(absl::InternalError(absl::StrCat("policy setup: ", attention.status().message())));
  }
  auto r = std::make_shared<DecodeRequest>();
  r->id = id;
  r->admission_seq = ++admission_seq_;
  r->attention = attention->get();
  r->seq = std::make_unique<model::Sequence>(std::move(*attention), n);
  r->sampler.emplace(*sampling);
  // Draw 0 of the request's stream sampled the first token on the prefill node; the next token is
  // draw 1 (PROTOCOL.md), so a seeded request gives the tokens of single-process generation.
  (void)r->sampler->Sample(std::vector<float>{0.0f});
  r->stop_ids.assign(sp.stop_token_ids().begin(), sp.stop_token_ids().end());
  if (!sp.ignore_eos()) {
    for (int64_t eos : config.eos_token_ids) r->stop_ids.push_back(static_cast<int32_t>(eos));
  }
  r->max_tokens = max_tokens;
  r->context_limit = context_limit;
  const Finish first = AcceptToken(*r, static_cast<int32_t>(landed.first_token_id()));
  if (first != Finish::kNone) {
    EndRequest(*r, first, absl::OkStatus());  // its reservations wake the admission's waiters
  } else {
    scheduler_->Join(r);
  }
  {
    absl::MutexLock lock(&mu_);
    live->request = r;
  }
  timing.set_load_us(MicrosBetween(t_prefilled, Clock::now()));

  // 5. Stream until the request ends.
  bool client_gone = false, deadline_hit = false;
  uint32_t sent = 0;
  Clock::time_point t_first_sent{};
  Finish finish = Finish::kNone;
  while (true) {
    std::vector<int32_t> tokens;
    {
      absl::MutexLock lock(&r->mu);
      auto ready = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) {
        return !r->pending.empty() || r->finish != Finish::kNone;
      };
      r->mu.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(20));
      tokens.swap(r->pending);
      finish = r->finish;
    }
    if (!tokens.empty() && !client_gone) {
      sent += static_cast<uint32_t>(tokens.size());
      v1::GenerateResponse msg;
      v1::GenerateChunk* chunk = msg.mutable_chunk();
      for (int32_t t : tokens) chunk->add_token_ids(static_cast<uint32_t>(t));
      chunk->set_completion_tokens(sent);
      if (t_first_sent == Clock::time_point{}) {
        t_first_sent = Clock::now();
        timing.set_ttft_us(MicrosBetween(t_arrival, t_first_sent));
      }
      if (!writer->Write(msg)) {
        client_gone = true;
        r->abort = true;
      }
    }
    if (finish != Finish::kNone) break;
    if (context->IsCancelled()) {
      client_gone = true;
      r->abort = true;
    }
    if (live->aborted.load()) r->abort = true;
    if (!deadline_hit && absl::Now() >= deadline) {
      deadline_hit = true;
      r->abort = true;
    }
  }
  const Clock::time_point t_end = Clock::now();
  usage.set_completion_tokens(sent);
  timing.set_decode_us(MicrosBetween(t_first_sent, t_end));
  if (sent > 1) timing.set_tpot_mean_us(static_cast<double>(timing.decode_us()) / (sent - 1));
  absl::Status error;
  std::optional<int32_t> matched;
  double read_fraction = 1.0;
  bool preempted = false;
  sparse::SelectionStats sparse_stats;
  {
    absl::MutexLock lock(&r->mu);
    timing.set_tpot_max_us(r->max_step_us);
    error = r->error;
    matched = r->matched_stop;
    read_fraction = r->read_fraction;
    preempted = r->preempted;
    sparse_stats = r->sparse_stats;
  }
  {
    absl::MutexLock lock(&mu_);
    metrics_.completion_tokens += sent;
    switch (finish) {
      case Finish::kStop: ++metrics_.finished_stop; break;
      case Finish::kLength: ++metrics_.finished_length; break;
      case Finish::kAbort: ++metrics_.finished_abort; break;
      default: ++(preempted ? metrics_.finished_preempted : metrics_.finished_error);
    }
  }
  if (node_metrics != nullptr) {
    FinishedRequestStats stats;
    stats.ttft_seconds = sent > 0 ? timing.ttft_us() * 1e-6 : -1;
    stats.e2e_seconds = MicrosBetween(t_arrival, t_end) * 1e-6;
    stats.completion_tokens = sent;
    stats.policy = policy->name;
    stats.read_fraction = read_fraction;
    stats.sparse = sparse_stats;
    node_metrics->OnFinished(stats);
  }
  if (client_gone) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
  v1::GenerateResponse msg;
  if (finish == Finish::kError || (finish == Finish::kAbort && deadline_hit)) {
    if (finish == Finish::kAbort) {
      error = absl::DeadlineExceededError(absl::StrCat(
          "request '", id, "' ran out of its time budget after ", sent, " tokens"));
    }
    v1::GenerateError* e = msg.mutable_error();
    e->set_code(static_cast<int32_t>(error.code()));
    e->set_message(std::string(error.message()));
    *e->mutable_usage() = usage;
    *e->mutable_timing() = timing;
    writer->WriteLast(msg, grpc::WriteOptions());
    return ToGrpcStatus(error);
  }
  v1::GenerateComplete* done = msg.mutable_complete();
  done->set_finish_reason(finish == Finish::kStop     ? v1::FINISH_REASON_STOP
                          : finish == Finish::kLength ? v1::FINISH_REASON_LENGTH
                                                      : v1::FINISH_REASON_ABORT);
  if (matched.has_value()) done->set_matched_stop_token_id(static_cast<uint32_t>(*matched));
  *done->mutable_usage() = usage;
  *done->mutable_timing() = timing;
  done->set_sparse_policy(sparse::PolicyLabel(*policy));
  done->set_read_fraction(static_cast<float>(read_fraction));
  if (finish == Finish::kAbort) {
    absl::MutexLock lock(&mu_);
    done->set_abort_reason(live->abort_reason);
  }
  writer->WriteLast(msg, grpc::WriteOptions());
  return grpc::Status::OK;
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
