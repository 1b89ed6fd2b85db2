#include "prefill/prefill_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
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
#include "transfer/page_meta.h"

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

namespace {
model::AttentionShape ShapeOf(const model::ModelConfig& c) {
  return model::AttentionShape{c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                               1.0f / std::sqrt(static_cast<float>(c.head_dim))};
}
}  // namespace

PrefillEngine::PrefillEngine(const model::Model* model, transfer::Transport* transport,
                             const v1::ModelLayout& layout, const PrefillEngineOptions& options)
    : model_(model),
      device_(nullptr),
      config_(model->config()),
      shape_(model->attention_shape()),
      transport_(transport),
      layout_(layout),
      options_(options) {}

PrefillEngine::PrefillEngine(DevicePrefill* device, transfer::Transport* transport,
                             const v1::ModelLayout& layout, const PrefillEngineOptions& options)
    : model_(nullptr),
      device_(device),
      config_(device->config()),
      shape_(ShapeOf(device->config())),
      transport_(transport),
      layout_(layout),
      options_(options) {}

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
  // Every layer's pages, the copy source of the writes. Not zero-filled for the device (its pages
  // arrive whole from HBM; clearing 16 GiB at 128K would cost seconds of TTFT), zeroed for the CPU
  // packer, which leaves the rows past the prompt's end as it finds them.
  std::unique_ptr<uint8_t[]> owned_staging;  // the CPU path's; the device path borrows its pinned one
  uint8_t* staging = nullptr;
  size_t staging_bytes = 0;
  std::unique_ptr<transfer::Registration> staging_reg;
  std::string state_blob;  // the serialized sparse state, a copy source like `staging`
  std::unique_ptr<transfer::Registration> state_reg;
  // Per-page metadata (transfer/page_meta.h), one block per layer: on the CPU path encoded from
  // `staging` as each layer completes (into `owned_meta`); on the device path computed on the GPU
  // and copied with the pages into the pinned staging, after them. A copy source like `staging`.
  bool want_meta = false;
  bool meta_from_device = false;
  uint64_t meta_layer_bytes = 0;
  std::vector<uint32_t> meta_target;  // per page_meta_target extent: its target
  std::vector<uint8_t> owned_meta;
  uint8_t* meta = nullptr;
  size_t meta_bytes = 0;
  std::unique_ptr<transfer::Registration> meta_reg;
  std::vector<uint64_t> meta_checksums;
  std::unique_ptr<Submitted> submitted;
  std::vector<uint64_t> checksums;
  std::vector<int64_t> sent;  // pages per head already submitted, per layer
  // Pages per head already hashed and encoded, per layer, and each (layer, KV head)'s CRC-32C so
  // far: the per-layer work runs piece by piece as pages complete, not all at a layer's end
  // (chunk-major, every layer ends during the last chunk: 17 GB at once at 128K, session 13).
  std::vector<int64_t> digested;
  std::vector<uint32_t> head_crcs;
  SendingAttention* attention = nullptr;  // the CPU path's
  std::optional<model::SparseState> device_state;  // the device path's capture
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
  const model::ModelConfig& config = config_;
  const model::AttentionShape shape = shape_;
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
  std::vector<uint32_t> meta_target = std::move(valid.meta_target);
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
  j->meta_target = std::move(meta_target);
  j->want_meta = valid.want_meta;
  j->sampling = sampling;
  j->who = who;
  j->targets = std::move(connected);

  // 3. Forward, sending each layer as it completes. The staging buffer holds every layer's pages
  // in PAGE_ORDER_LAYER_HEAD_PAGE order, so consecutive reserved page ids coalesce into one put.
  j->ppl = geo.pages_per_layer(n);
  j->layer_bytes = static_cast<uint64_t>(j->ppl) * cb;
  j->staging_bytes = j->layer_bytes * shape.num_layers;
  if (j->want_meta) {
    j->meta_layer_bytes = transfer::PageMetaLayerBytes(geo, n);
    j->meta_bytes = j->meta_layer_bytes * shape.num_layers;
  }
  if (device_ != nullptr) {  // REQUIRES: device_mu_ held (RunBatch)
    // One pinned buffer: the pages, then the page records the device computes beside them.
    FLUXION_ASSIGN_OR_RETURN(j->staging,
                             device_->HostStaging(j->staging_bytes + j->meta_bytes));
    j->meta = j->want_meta ? j->staging + j->staging_bytes : nullptr;
    j->meta_from_device = j->want_meta;
  } else {
    j->owned_staging.reset(new uint8_t[j->staging_bytes]);
    j->staging = j->owned_staging.get();
    std::memset(j->staging, 0, j->staging_bytes);
    j->owned_meta.resize(j->meta_bytes);
    j->meta = j->want_meta ? j->owned_meta.data() : nullptr;
  }
  FLUXION_ASSIGN_OR_RETURN(
      j->staging_reg,
      transport_->Register({j->staging, j->staging_bytes}, {/*remote_write=*/false}));
  j->crc = kv.checksum_algorithm() == v1::CHECKSUM_ALGORITHM_CRC32C;
  j->checksums.assign(shape.num_layers, 0);
  if (j->want_meta) {
    FLUXION_ASSIGN_OR_RETURN(
        j->meta_reg, transport_->Register({j->meta, j->meta_bytes}, {/*remote_write=*/false}));
    j->meta_checksums.assign(shape.num_layers, 0);
  }
  j->submitted = std::make_unique<Submitted>(options_.transfer_timeout);
  j->sent.assign(shape.num_layers, 0);
  j->digested.assign(shape.num_layers, 0);
  j->head_crcs.assign(shape.num_layers * shape.num_kv_heads, 0);
  j->prompt.assign(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
  if (device_ != nullptr) return job;
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
  return job;
}

// Submits pages [p0, p1) of every KV head of layers [l0, l1) of `j` as one batch.
absl::Status PrefillEngine::Submit(Job& j, int64_t l0, int64_t l1, int64_t p0, int64_t p1) const {
  const model::AttentionShape& shape = shape_;
  const v1::KvTarget& kv = j.request->kv_target();
  // One batch per range written (each range is its own target with its own key).
  std::vector<std::vector<transfer::BlockCopy>> copies(j.targets.size());
  for (int64_t l = l0; l < l1; ++l) {
    for (int64_t h = 0; h < shape.num_kv_heads; ++h) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t idx = l * j.ppl + h * j.per_head + p;
        copies[j.page_target[idx]].push_back(
            {kv.arena_base_address() + j.page_ids[idx] * kv.page_bytes(),
             j.staging + idx * j.cb, j.cb});
      }
    }
  }
  return WriteEach(j, copies);
}

// Submits the page-metadata blocks of layers [l0, l1) of `j`: stream bytes
// [l0 * block, l1 * block) split across the page_meta_target extents they fall in.
absl::Status PrefillEngine::SubmitMeta(Job& j, int64_t l0, int64_t l1) const {
  const v1::PageMetaTarget& mt = j.request->page_meta_target();
  const uint64_t begin = l0 * j.meta_layer_bytes, end = l1 * j.meta_layer_bytes;
  std::vector<std::vector<transfer::BlockCopy>> copies(j.targets.size());
  uint64_t at = 0;  // stream offset of extent i
  for (int i = 0; i < mt.extents_size() && at < end; ++i) {
    const v1::ByteExtent& e = mt.extents(i);
    const uint64_t lo = std::max(begin, at), hi = std::min(end, at + e.length());
    if (lo < hi) {
      copies[j.meta_target[i]].push_back(
          {mt.base_address() + e.offset() + (lo - at), j.meta + lo, hi - lo});
    }
    at += e.length();
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

absl::Status PrefillEngine::CheckCancelled(const Job& j, int layer) const {
  if (!j.cancelled()) return absl::OkStatus();
  return absl::CancelledError(absl::StrCat("prefill of request '", j.request->request_id(),
                                           "' aborted at layer ", layer + 1));
}

// The CPU path's per-piece, per-layer hook of `j`'s attention: checks for cancellation, packs the
// rows, sends the pages they complete, and checksums a finished layer.
absl::Status PrefillEngine::OnRows(Job& j, int layer, int64_t first, int64_t end) const {
  FLUXION_RETURN_IF_ERROR(CheckCancelled(j, layer));
  const int64_t row = shape_.num_kv_heads * shape_.head_dim;
  const model::DenseAttention& dense = j.attention->dense();
  uint8_t* dst = j.staging + layer * j.layer_bytes;
  transfer::PackLayerRows(j.geo, j.n, first, end, dense.keys(layer) + first * row,
                          dense.values(layer) + first * row, row, dst);
  return SendCompleted(j, layer, end);
}

absl::Status PrefillEngine::SendCompleted(Job& j, int layer, int64_t end) const {
  const bool layer_done = end == j.n;
  // Pages whose every row is computed (the last one once the prompt ends).
  const int64_t complete = layer_done ? j.per_head : end / j.geo.page_tokens;
  if (options_.layerwise && complete > j.sent[layer]) {
    FLUXION_RETURN_IF_ERROR(Submit(j, layer, layer + 1, j.sent[layer], complete));
    j.sent[layer] = complete;
  }
  Digest(j, layer, complete);
  if (layer_done) {
    if (j.crc) {  // the layer's pages in wire order: head 0's, then head 1's, ...
      const int64_t hkv = shape_.num_kv_heads;
      uint32_t crc = j.head_crcs[layer * hkv];
      for (int64_t h = 1; h < hkv; ++h) {
        crc = transfer::Crc32cCombine(crc, j.head_crcs[layer * hkv + h], j.per_head * j.cb);
      }
      j.checksums[layer] = crc;
    }
    if (j.want_meta) {
      uint8_t* block = j.meta + layer * j.meta_layer_bytes;
      if (j.crc) j.meta_checksums[layer] = transfer::Crc32c(block, j.meta_layer_bytes);
      if (options_.layerwise) FLUXION_RETURN_IF_ERROR(SubmitMeta(j, layer, layer + 1));
    }
    if (options_.layer_delay > absl::ZeroDuration()) absl::SleepFor(options_.layer_delay);
  }
  return absl::OkStatus();
}

// Hashes the pages of `layer` that became complete since the last call and, on the CPU path,
// encodes their page bounds, from the staging copy while it is warm (the device path's bounds
// came from the GPU with the pages).
void PrefillEngine::Digest(Job& j, int layer, int64_t complete) const {
  const int64_t p0 = j.digested[layer];
  if (complete <= p0) return;
  const int64_t hkv = shape_.num_kv_heads;
  const uint8_t* layer_pages = j.staging + layer * j.layer_bytes;
  if (j.crc) {
    for (int64_t h = 0; h < hkv; ++h) {
      uint32_t& crc = j.head_crcs[layer * hkv + h];
      crc = transfer::Crc32cExtend(crc, layer_pages + (h * j.per_head + p0) * j.cb,
                                   static_cast<size_t>(complete - p0) * j.cb);
    }
  }
  if (j.want_meta && !j.meta_from_device) {  // the device's arrive with their pages
    transfer::EncodePageMetaRange(j.geo, j.n, layer_pages, p0, complete,
                                  j.meta + layer * j.meta_layer_bytes);
  }
  j.digested[layer] = complete;
}

// One request through the device's forward. The copy thread calls back with each piece once its
// pages are on the host: cancellation is checked there too, then the piece is sent.
void PrefillEngine::RunOnDevice(Job& j) const {
  absl::StatusOr<DevicePrefillResult> r = device_->Run(
      j.prompt, j.geo.page_tokens, j.staging, j.meta_from_device ? j.meta : nullptr,
      j.request->has_sparse_target(), j.cancelled,
      [this, &j](int layer, int64_t, int64_t end) -> absl::Status {
        FLUXION_RETURN_IF_ERROR(CheckCancelled(j, layer));
        return SendCompleted(j, layer, end);
      });
  if (!r.ok()) {
    j.forward = r.status();
    j.t_compute_end = Clock::now();
    return;
  }
  j.logits = std::move(r->logits);
  j.device_state = std::move(r->state);
  j.t_compute_end = r->forward_end;
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::Finish(Job& j) const {
  return Land(&j, FinishCompute(j));
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::FinishCompute(Job& j) const {
  const model::AttentionShape& shape = shape_;
  const v1::PrefillRequest& request = *j.request;
  const v1::KvTarget& kv = request.kv_target();
  // Every error below is returned without waiting for the writes already submitted: Land waits
  // for them before the reply goes out ("stopped writing before we say so").
  Submitted& submitted = *j.submitted;
  if (!j.forward.ok()) return j.forward;
  if (!options_.layerwise) {
    absl::Status s = Submit(j, 0, shape.num_layers, 0, j.per_head);
    if (s.ok() && j.want_meta) s = SubmitMeta(j, 0, shape.num_layers);
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
        j.device_state.has_value() ? *std::move(j.device_state)
                                   : model::CaptureSparseState(j.attention->dense(), shape);
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
  response.set_kv_bytes_written(j.staging_bytes);
  if (j.want_meta) {
    v1::PageMetaSummary* meta = response.mutable_page_meta();
    meta->set_format_version(transfer::kPageMetaVersion);
    meta->set_bytes_written(j.meta_bytes);
    if (j.crc) {
      for (uint64_t c : j.meta_checksums) meta->add_layer_checksums(c);
    }
  }
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
  if (device_ != nullptr) {
    // On the GPU: one request at a time from preparation to reply (they share the device's pinned
    // staging, so the next may start only once these writes stopped): Finish waits for them here,
    // and the Landing handed over is already done.
    std::lock_guard<std::mutex> lock(device_mu_);
    for (size_t i = 0; i < requests.size(); ++i) {
      absl::StatusOr<std::unique_ptr<Job>> job = Prepare(*requests[i], cancelled[i]);
      if (!job.ok()) {
        reply(i, std::make_unique<Landing>(nullptr, job.status()));
        continue;
      }
      Job& j = **job;
      j.index = i;
      j.t_compute = Clock::now();
      RunOnDevice(j);
      reply(i, std::make_unique<Landing>(nullptr, Finish(j)));
    }
    return;
  }
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
