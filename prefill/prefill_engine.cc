#include "prefill/prefill_engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/dense_attention.h"
#include "model/generator.h"
#include "model/sampler.h"
#include "model/sparse_state.h"
#include "prefill/prefill_validation.h"
#include "proto/convert.h"
#include "transfer/crc32c.h"
#include "transfer/kv_pages.h"

namespace fluxion::prefill {
namespace {

namespace v1 = ::fluxion::v1;
using Clock = std::chrono::steady_clock;

uint64_t MicrosBetween(Clock::time_point a, Clock::time_point b) {
  return b > a ? std::chrono::duration_cast<std::chrono::microseconds>(b - a).count() : 0;
}

// The prefill's own full attention, which hands every computed piece of a layer (a prompt chunk:
// the model runs long prompts in chunks) to `on_rows(layer, first, end)` right after storing it:
// the hook that packs and sends those rows' pages while the model goes on with the next layer,
// and that checks for cancellation. An error from the hook stops the forward.
class SendingAttention : public model::SequenceAttention {
 public:
  SendingAttention(const model::AttentionShape& shape, int64_t tokens,
                   std::function<absl::Status(int, int64_t, int64_t)> on_rows)
      : dense_(shape), on_rows_(std::move(on_rows)) {
    dense_.RecordQueries(std::max<int64_t>(0, tokens - model::kPrefillTailRows), tokens);
  }

  absl::Status Forward(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                       const float* v, float* out) override {
    FLUXION_RETURN_IF_ERROR(dense_.Forward(layer, pos0, n, q, k, v, out));
    return on_rows_(layer, pos0, pos0 + n);
  }

  const model::DenseAttention& dense() const { return dense_; }

 private:
  model::DenseAttention dense_;
  std::function<absl::Status(int, int64_t, int64_t)> on_rows_;
};

// Everything submitted for one request, so that every exit path waits for it first.
class Submitted {
 public:
  explicit Submitted(absl::Duration timeout) : timeout_(timeout) {}
  ~Submitted() { (void)WaitAll(); }  // exits that forgot to wait still honour "reply = stopped"

  void Add(std::unique_ptr<transfer::TransferHandle> h) {
    if (handles_.empty()) first_submit_ = Clock::now();
    handles_.push_back(std::move(h));
  }
  bool empty() const { return handles_.empty(); }
  Clock::time_point first_submit() const { return first_submit_; }

  // Waits for every batch, each bounded by what is left of the lease; the first error wins.
  absl::Status WaitAll() {
    const absl::Time deadline = absl::Now() + timeout_;
    absl::Status first;
    for (auto& h : handles_) {
      absl::Status s = h->Wait(std::max(absl::ZeroDuration(), deadline - absl::Now()));
      if (!s.ok() && first.ok()) first = s;
    }
    handles_.clear();
    return first;
  }

 private:
  const absl::Duration timeout_;
  std::vector<std::unique_ptr<transfer::TransferHandle>> handles_;
  Clock::time_point first_submit_{};
};

absl::Status Annotate(const absl::Status& s, const std::string& prefix) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

}  // namespace

PrefillEngine::PrefillEngine(const model::Model* model, transfer::Transport* transport,
                             const v1::ModelLayout& layout, const PrefillEngineOptions& options)
    : model_(model), transport_(transport), layout_(layout), options_(options) {}

// One request of a (possibly one-request) batch: everything its forward hook, its sends and
// its reply need. Members that writes read from (the staging buffer, the state blob, their
// registrations, the target) are declared before `submitted`, so they outlive its wait.
struct PrefillEngine::Job {
  size_t index = 0;
  const v1::PrefillRequest* request = nullptr;
  std::function<bool()> cancelled;
  Clock::time_point t_start, t_compute, t_compute_end;
  int64_t n = 0;
  transfer::KvPageGeometry geo;
  int64_t per_head = 0, ppl = 0;
  uint64_t cb = 0, layer_bytes = 0;
  std::vector<uint64_t> page_ids;
  // Per page and per sparse-state extent: which of `targets` (one per range used) it lies in.
  std::vector<uint32_t> page_target, state_target;
  model::SamplingParams sampling;
  std::string who;
  bool crc = false;
  std::vector<std::unique_ptr<transfer::RemoteTarget>> targets;
  std::vector<uint8_t> staging;
  std::unique_ptr<transfer::Registration> staging_reg;
  std::string state_blob;  // the serialized sparse state, a copy source like `staging`
  std::unique_ptr<transfer::Registration> state_reg;
  std::unique_ptr<Submitted> submitted;
  std::vector<uint64_t> checksums;
  std::vector<int64_t> sent;  // pages per head already submitted, per layer
  SendingAttention* attention = nullptr;
  std::unique_ptr<model::Sequence> seq;
  std::vector<int32_t> prompt;
  std::vector<float> logits;
  absl::Status forward;
  // In a batch: answers this request the moment its hook fails (it then leaves the batch), so it
  // does not wait for the rest of the others' piece. Null when alone.
  const Handoff* early_handoff = nullptr;
  bool replied = false;
  // Itself, for the Landing a hook hands off while the batch still holds the job.
  std::weak_ptr<Job> self;
  // Set by Finish for Land: compute over, first write submitted.
  Clock::time_point t_all_computed, t_first_submit;

  ~Job() {
    if (submitted != nullptr) (void)submitted->WaitAll();
  }
};

absl::StatusOr<std::unique_ptr<PrefillEngine::Job>> PrefillEngine::Prepare(
    const v1::PrefillRequest& request, const std::function<bool()>& cancelled) const {
  const Clock::time_point t_start = Clock::now();
  const model::ModelConfig& config = model_->config();
  const model::AttentionShape shape = model_->attention_shape();
  const int64_t n = request.prompt_token_ids_size();

  // 1. Validate everything before touching the decode node's memory
  // (prefill/prefill_validation.h).
  FLUXION_ASSIGN_OR_RETURN(
      ValidatedPrefill valid,
      ValidatePrefillRequest(request, PrefillLimits{config.vocab_size,
                                                    config.max_position_embeddings, shape,
                                                    &layout_, std::string(transport_->kind())}));
  const v1::KvTarget& kv = request.kv_target();
  const uint32_t version = valid.version;
  const model::SamplingParams& sampling = valid.sampling;
  const transfer::KvPageGeometry geo = valid.geo;
  const uint64_t cb = valid.content_bytes;
  const int64_t per_head = valid.per_head;
  std::vector<uint64_t> page_ids = std::move(valid.page_ids);
  const std::vector<WritableRange>& ranges = valid.ranges;
  const std::vector<int>& used = valid.used;
  std::vector<uint32_t> page_target = std::move(valid.page_target);
  std::vector<uint32_t> state_target = std::move(valid.state_target);
  const int targets = valid.targets;

  // 2. Connect once per range used (the endpoint is cached per decode-node incarnation inside the
  // transport; each range brings its own key).
  const std::string who = absl::StrCat("decode node ", kv.peer_name(), ": ");
  std::vector<std::unique_ptr<transfer::RemoteTarget>> connected(targets);
  for (size_t range = 0; range < ranges.size(); ++range) {
    if (used[range] < 0) continue;
    transfer::PeerDescriptor peer;
    peer.peer_name = kv.peer_name();
    peer.transport = kv.transport();
    peer.worker_address = kv.worker_address();
    peer.remote_key = *ranges[range].key;
    peer.base_address = ranges[range].base;
    peer.length = ranges[range].length;
    peer.compat = proto::CompatibilityOf(request.layout(), version);
    absl::StatusOr<std::unique_ptr<transfer::RemoteTarget>> target = transport_->Connect(peer);
    if (!target.ok()) return Annotate(target.status(), who);
    connected[used[range]] = std::move(*target);
  }

  auto job = std::make_unique<Job>();
  Job* j = job.get();
  j->request = &request;
  j->cancelled = cancelled;
  j->t_start = t_start;
  j->n = n;
  j->geo = geo;
  j->per_head = per_head;
  j->cb = cb;
  j->page_ids = std::move(page_ids);
  j->page_target = std::move(page_target);
  j->state_target = std::move(state_target);
  j->sampling = sampling;
  j->who = who;
  j->targets = std::move(connected);

  // 3. Forward, sending each layer as it completes. The staging buffer holds every layer's pages
  // in PAGE_ORDER_LAYER_HEAD_PAGE order, so consecutive reserved page ids coalesce into one put.
  j->ppl = geo.pages_per_layer(n);
  j->layer_bytes = static_cast<uint64_t>(j->ppl) * cb;
  j->staging.resize(j->layer_bytes * shape.num_layers);
  FLUXION_ASSIGN_OR_RETURN(
      j->staging_reg,
      transport_->Register({j->staging.data(), j->staging.size()}, {/*remote_write=*/false}));
  j->crc = kv.checksum_algorithm() == v1::CHECKSUM_ALGORITHM_CRC32C;
  j->checksums.assign(shape.num_layers, 0);
  j->submitted = std::make_unique<Submitted>(options_.transfer_timeout);
  j->sent.assign(shape.num_layers, 0);
  auto owned = std::make_unique<SendingAttention>(
      shape, n, [this, j](int layer, int64_t first, int64_t end) -> absl::Status {
        absl::Status s = OnRows(*j, layer, first, end);
        if (!s.ok() && j->early_handoff != nullptr && !j->replied) {
          j->forward = s;
          j->t_compute_end = Clock::now();
          // The Landing shares the job: the batch's forward still holds its sequence.
          (*j->early_handoff)(j->index,
                              std::make_unique<Landing>(j->self.lock(), FinishCompute(*j)));
          j->replied = true;
        }
        return s;
      });
  j->attention = owned.get();
  j->seq = std::make_unique<model::Sequence>(std::move(owned));
  j->prompt.assign(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
  return job;
}

// Submits pages [p0, p1) of every KV head of layers [l0, l1) of `j` as one batch.
absl::Status PrefillEngine::Submit(Job& j, int64_t l0, int64_t l1, int64_t p0, int64_t p1) const {
  const model::AttentionShape shape = model_->attention_shape();
  const v1::KvTarget& kv = j.request->kv_target();
  // One batch per range written (each range is its own target with its own key).
  std::vector<std::vector<transfer::BlockCopy>> copies(j.targets.size());
  for (int64_t l = l0; l < l1; ++l) {
    for (int64_t h = 0; h < shape.num_kv_heads; ++h) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t idx = l * j.ppl + h * j.per_head + p;
        copies[j.page_target[idx]].push_back(
            {kv.arena_base_address() + j.page_ids[idx] * kv.page_bytes(),
             j.staging.data() + idx * j.cb, j.cb});
      }
    }
  }
  return WriteEach(j, copies);
}

absl::Status PrefillEngine::WriteEach(
    Job& j, const std::vector<std::vector<transfer::BlockCopy>>& per_target) const {
  for (size_t t = 0; t < per_target.size(); ++t) {
    if (per_target[t].empty()) continue;
    absl::StatusOr<std::unique_ptr<transfer::TransferHandle>> h =
        transport_->Write(*j.targets[t], per_target[t]);
    if (!h.ok()) return Annotate(h.status(), j.who);
    j.submitted->Add(std::move(*h));
  }
  return absl::OkStatus();
}

// The per-piece, per-layer hook of `j`'s attention: checks for cancellation, packs the rows,
// sends the pages they complete, and checksums a finished layer.
absl::Status PrefillEngine::OnRows(Job& j, int layer, int64_t first, int64_t end) const {
  if (j.cancelled()) {
    return absl::CancelledError(absl::StrCat("prefill of request '", j.request->request_id(),
                                             "' aborted at layer ", layer + 1));
  }
  const model::AttentionShape shape = model_->attention_shape();
  const int64_t row = shape.num_kv_heads * shape.head_dim;
  const model::DenseAttention& dense = j.attention->dense();
  uint8_t* dst = j.staging.data() + layer * j.layer_bytes;
  transfer::PackLayerRows(j.geo, j.n, first, end, dense.keys(layer) + first * row,
                          dense.values(layer) + first * row, row, dst);
  const bool layer_done = end == j.n;
  // Pages whose every row is computed (the last one once the prompt ends).
  const int64_t complete = layer_done ? j.per_head : end / j.geo.page_tokens;
  if (options_.layerwise && complete > j.sent[layer]) {
    FLUXION_RETURN_IF_ERROR(Submit(j, layer, layer + 1, j.sent[layer], complete));
    j.sent[layer] = complete;
  }
  if (layer_done) {
    if (j.crc) j.checksums[layer] = transfer::Crc32c(dst, j.layer_bytes);
    if (options_.layer_delay > absl::ZeroDuration()) absl::SleepFor(options_.layer_delay);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::Finish(Job& j) const {
  return Land(&j, FinishCompute(j));
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::FinishCompute(Job& j) const {
  const model::AttentionShape shape = model_->attention_shape();
  const v1::PrefillRequest& request = *j.request;
  const v1::KvTarget& kv = request.kv_target();
  // Every error below is returned without waiting for the writes already submitted: Land waits
  // for them before the reply goes out ("stopped writing before we say so").
  Submitted& submitted = *j.submitted;
  if (!j.forward.ok()) return j.forward;
  if (!options_.layerwise) {
    absl::Status s = Submit(j, 0, shape.num_layers, 0, j.per_head);
    if (!s.ok()) return s;
  }

  // 4. The sparse state, into the room reserved for it.
  v1::PrefillResponse response;
  Clock::time_point t_state_end = j.t_compute_end;
  if (j.cancelled()) {  // the capture below is not interruptible: do not start it for nothing
    return absl::CancelledError(absl::StrCat("prefill of request '", request.request_id(),
                                             "' aborted after the forward"));
  }
  if (request.has_sparse_target()) {
    const v1::SparseStateTarget& st = request.sparse_target();
    absl::StatusOr<model::SparseState> state =
        model::CaptureSparseState(j.attention->dense(), shape);
    if (!state.ok()) return state.status();
    j.state_blob = state->Serialize();
    absl::StatusOr<std::unique_ptr<transfer::Registration>> reg = transport_->Register(
        {j.state_blob.data(), j.state_blob.size()}, {/*remote_write=*/false});
    if (!reg.ok()) return reg.status();
    j.state_reg = std::move(*reg);
    std::vector<std::vector<transfer::BlockCopy>> copies(j.targets.size());
    uint64_t done = 0;
    for (int i = 0; i < st.extents_size(); ++i) {
      const v1::ByteExtent& e = st.extents(i);
      if (done == j.state_blob.size()) break;
      const uint64_t len = std::min<uint64_t>(e.length(), j.state_blob.size() - done);
      copies[j.state_target[i]].push_back(
          {st.base_address() + e.offset(), j.state_blob.data() + done, len});
      done += len;
    }
    if (absl::Status s = WriteEach(j, copies); !s.ok()) return s;
    v1::SparseStateSummary* summary = response.mutable_sparse_state();
    summary->set_format_version(model::kSparseStateVersion);
    summary->set_bytes_written(j.state_blob.size());
    summary->set_observation_window_tokens(static_cast<uint32_t>(state->tail_rows));
    summary->set_score_block_tokens(1);
    t_state_end = Clock::now();
    if (j.crc) summary->set_checksum(transfer::Crc32c(j.state_blob.data(), j.state_blob.size()));
  }

  // 5. The first token. Waiting until every write has landed is Land's.
  model::Sampler sampler(j.sampling);
  const int32_t first = sampler.Sample(j.logits);
  j.t_all_computed = Clock::now();
  j.t_first_submit = submitted.first_submit();

  response.set_first_token_id(static_cast<uint32_t>(first));
  response.set_prompt_tokens(static_cast<uint32_t>(j.n));
  response.set_checksum_algorithm(kv.checksum_algorithm());
  if (j.crc) {
    for (uint64_t c : j.checksums) response.add_layer_checksums(c);
  }
  response.set_kv_bytes_written(j.staging.size());
  v1::PrefillTiming* timing = response.mutable_timing();
  timing->set_compute_us(MicrosBetween(j.t_compute, j.t_compute_end));
  timing->set_sparse_state_us(MicrosBetween(j.t_compute_end, t_state_end));
  return response;
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::Land(Job* j,
                                                        absl::StatusOr<v1::PrefillResponse> computed) {
  if (j == nullptr) return computed;  // refused before anything was submitted
  absl::Status landed = j->submitted->WaitAll();
  if (!computed.ok()) return computed;
  if (!landed.ok()) return Annotate(landed, absl::StrCat(j->who, "KV writes did not complete: "));
  const Clock::time_point t_end = Clock::now();
  v1::PrefillTiming* timing = computed->mutable_timing();
  timing->set_transfer_us(MicrosBetween(j->t_first_submit, t_end));
  timing->set_transfer_tail_us(MicrosBetween(j->t_all_computed, t_end));
  timing->set_total_us(MicrosBetween(j->t_start, t_end));
  return computed;
}

PrefillEngine::Landing::Landing(std::shared_ptr<Job> job,
                                absl::StatusOr<v1::PrefillResponse> computed)
    : job_(std::move(job)), computed_(std::move(computed)) {}

PrefillEngine::Landing::~Landing() {
  if (!waited_) (void)Wait();
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::Landing::Wait() {
  waited_ = true;
  return Land(job_.get(), std::move(computed_));
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::Run(const v1::PrefillRequest& request,
                                                       const std::function<bool()>& cancelled) const {
  absl::StatusOr<v1::PrefillResponse> result = absl::InternalError("no reply");
  const v1::PrefillRequest* one[] = {&request};
  const std::function<bool()> fns[] = {cancelled};
  RunBatch(one, fns, [&](size_t, absl::StatusOr<v1::PrefillResponse> r) { result = std::move(r); });
  return result;
}

void PrefillEngine::RunBatch(absl::Span<const v1::PrefillRequest* const> requests,
                             absl::Span<const std::function<bool()>> cancelled,
                             const Reply& reply) const {
  RunBatchDeferred(requests, cancelled, [&](size_t i, std::unique_ptr<Landing> landing) {
    reply(i, landing->Wait());
  });
}

void PrefillEngine::RunBatchDeferred(absl::Span<const v1::PrefillRequest* const> requests,
                                     absl::Span<const std::function<bool()>> cancelled,
                                     const Handoff& handoff) const {
  const Handoff& reply = handoff;
  // Validate and connect each request; one that fails is answered at once.
  std::vector<std::shared_ptr<Job>> jobs;
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::StatusOr<std::unique_ptr<Job>> job = Prepare(*requests[i], cancelled[i]);
    if (!job.ok()) {
      reply(i, std::make_unique<Landing>(nullptr, job.status()));
      continue;
    }
    (*job)->index = i;
    std::shared_ptr<Job> shared = std::move(*job);
    shared->self = shared;
    jobs.push_back(std::move(shared));
  }
  if (jobs.empty()) return;
  const int64_t piece = std::max<int64_t>(1, options_.piece_tokens);
  const Clock::time_point t_compute = Clock::now();
  for (auto& j : jobs) j->t_compute = t_compute;
  if (jobs.size() == 1) {
    // Alone: the plain forward, piece by piece.
    Job& j = *jobs[0];
    for (int64_t first = 0; first < j.n && j.forward.ok(); first += piece) {
      j.forward = model_->Forward(*j.seq,
                                  absl::MakeConstSpan(j.prompt).subspan(first,
                                                                        std::min(piece, j.n - first)),
                                  &j.logits);
    }
    j.t_compute_end = Clock::now();
  } else {
    // Together: piece p of every request still computing goes through one batched forward. A
    // request whose hook fails (cancelled, a send refused) leaves the batch at that layer and is
    // answered from the hook, once its writes stopped, without waiting for the others.
    std::vector<model::Sequence*> seqs;
    std::vector<absl::Span<const int32_t>> spans;
    std::vector<Job*> in;
    std::vector<std::vector<float>> logits;
    std::vector<absl::Status> statuses;
    for (auto& j : jobs) j->early_handoff = &reply;
    for (int64_t first = 0;; first += piece) {
      seqs.clear();
      spans.clear();
      in.clear();
      for (auto& j : jobs) {
        if (!j->forward.ok() || first >= j->n) continue;
        in.push_back(j.get());
        seqs.push_back(j->seq.get());
        spans.push_back(absl::MakeConstSpan(j->prompt).subspan(first, std::min(piece, j->n - first)));
      }
      if (in.empty()) break;
      absl::Status s = model_->ForwardBatch(seqs, spans, &logits, &statuses);
      const Clock::time_point now = Clock::now();
      for (size_t b = 0; b < in.size(); ++b) {
        Job& j = *in[b];
        j.forward = s.ok() ? statuses[b] : s;
        if (!j.forward.ok()) {
          if (!j.replied) {  // failed outside its hook (not expected: inputs were validated)
            j.t_compute_end = now;
            reply(j.index, std::make_unique<Landing>(j.self.lock(), FinishCompute(j)));
            j.replied = true;
          }
        } else if (first + piece >= j.n) {
          j.logits = std::move(logits[b]);
          j.t_compute_end = now;
        }
      }
    }
  }
  for (auto& j : jobs) {  // the rest, in order; Finish answers a failed forward with its error
    if (!j->replied) reply(j->index, std::make_unique<Landing>(j, FinishCompute(*j)));
    j->replied = true;
  }
}

}  // namespace fluxion::prefill
