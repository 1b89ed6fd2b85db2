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
#include "model/sampler.h"
#include "model/sparse_state.h"
#include "prefill/cpu_prefill_device.h"
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

// Everything submitted for one request, so that every exit path waits for it first.
class Submitted {
 public:
  explicit Submitted(absl::Duration timeout) : timeout_(timeout) {}
  ~Submitted() { (void)WaitAll(); }  // exits that forgot to wait still honour "reply = stopped"

  void Add(std::unique_ptr<transfer::TransferHandle> h) {
    Note();
    handles_.push_back(std::move(h));
  }
  // A write was submitted (here or from the staging ring): the transfer's clock starts.
  void Note() {
    if (!any_) first_submit_ = Clock::now();
    any_ = true;
  }
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
  bool any_ = false;
  Clock::time_point first_submit_{};
};

absl::Status Annotate(const absl::Status& s, const std::string& prefix) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

}  // namespace

uint64_t StagingRingBytes(const PrefillEngineOptions& options, const transfer::KvPageGeometry& geo,
                          int64_t tokens) {
  const uint64_t kv = static_cast<uint64_t>(geo.total_pages(tokens)) * geo.content_bytes();
  return std::max<uint64_t>(static_cast<uint64_t>(geo.num_kv_heads) * geo.content_bytes(),
                            std::min<uint64_t>(options.staging_ring_bytes, kv));
}

namespace {
// A request's slice of the device path's pinned memory: its ring, then its page records, rounded
// up to whole 4 KiB pages so that every slice starts page-aligned.
size_t StagingSlice(size_t ring_bytes, size_t meta_bytes) {
  constexpr size_t kAlign = 4096;
  return (ring_bytes + meta_bytes + kAlign - 1) / kAlign * kAlign;
}
}  // namespace

uint64_t DeviceStagingBytes(const PrefillEngineOptions& options,
                            const transfer::KvPageGeometry& geo, int64_t tokens) {
  return StagingSlice(StagingRingBytes(options, geo, tokens), transfer::PageMetaBytes(geo, tokens));
}

namespace {
model::AttentionShape ShapeOf(const model::ModelConfig& c) {
  return model::AttentionShape{c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                               1.0f / std::sqrt(static_cast<float>(c.head_dim))};
}
}  // namespace

PrefillEngine::PrefillEngine(const model::Model* model, transfer::Transport* transport,
                             const v1::ModelLayout& layout, const PrefillEngineOptions& options)
    : owned_device_(std::make_unique<CpuPrefillDevice>(model, options.piece_tokens)),
      device_(owned_device_.get()),
      config_(model->config()),
      shape_(model->attention_shape()),
      transport_(transport),
      layout_(layout),
      options_(options) {}

PrefillEngine::PrefillEngine(PrefillDevice* device, transfer::Transport* transport,
                             const v1::ModelLayout& layout, const PrefillEngineOptions& options)
    : device_(device),
      config_(device->config()),
      shape_(ShapeOf(device->config())),
      transport_(transport),
      layout_(layout),
      options_(options) {}

// One request of a (possibly one-request) batch: everything its forward hook, its sends and
// its reply need. Members that writes read from (the staging ring's memory, the state blob, their
// registrations, the target) are declared before `ring` and `submitted`, so they outlive their
// waits.
struct PrefillEngine::Job {
  const PrefillEngine* engine = nullptr;  // for the Landing's drain
  size_t index = 0;         // in the batch's requests
  size_t device_index = 0;  // in the device forward's prompts (PrefillDevice::CopyPages)
  const v1::PrefillRequest* request = nullptr;
  std::function<bool()> cancelled;
  Clock::time_point t_start, t_compute, t_compute_end;
  int64_t n = 0;
  transfer::KvPageGeometry geo;
  int64_t per_head = 0, ppl = 0;
  uint64_t cb = 0;
  std::vector<uint64_t> page_ids;
  uint64_t arena_base = 0, remote_page_bytes = 0;  // the KvTarget's, copied: the Landing reads them
  // Per page and per sparse-state extent: which of `targets` (one per range used) it lies in.
  std::vector<uint32_t> page_target, state_target;
  model::SamplingParams sampling;
  std::string who;
  bool crc = false;
  std::vector<std::unique_ptr<transfer::RemoteTarget>> targets;
  // The staging ring's memory, the copy source of the page writes (prefill/staging_ring.h): the
  // request's own when its device's pages outlive the batch (PrefillDevice::PagesOutliveBatch),
  // else borrowed from the device's HostStaging. `slot_pages`: pages per head staged at most at
  // once, so that several slots are in flight.
  std::unique_ptr<uint8_t[]> owned_ring;
  uint8_t* ring_memory = nullptr;
  size_t ring_bytes = 0;
  int64_t slot_pages = 0;
  uint64_t kv_bytes = 0;  // every page of the prompt
  std::unique_ptr<transfer::Registration> ring_reg;
  std::string state_blob;  // the serialized sparse state, a copy source like `staging`
  std::unique_ptr<transfer::Registration> state_reg;
  // Per-page metadata (transfer/page_meta.h), one block per layer, written by the device with the
  // pages they describe (PrefillDevice::CopyPages), into `owned_meta` beside owned staging, else
  // into the device's staging after the ring. A copy source.
  bool want_meta = false;
  uint64_t meta_layer_bytes = 0;
  std::vector<uint32_t> meta_target;  // per page_meta_target extent: its target
  v1::PageMetaTarget meta_extents;      // the request's, copied: the Landing reads them
  std::vector<uint8_t> owned_meta;
  uint8_t* meta = nullptr;
  size_t meta_bytes = 0;
  std::unique_ptr<transfer::Registration> meta_reg;
  std::vector<uint64_t> meta_checksums;
  std::unique_ptr<StagingRing> ring;
  std::unique_ptr<Submitted> submitted;  // the sparse state's and the page records' writes
  std::vector<uint64_t> checksums;
  // Per layer, pages per head computed and pages per head staged (hashed, encoded and submitted),
  // and each (layer, KV head)'s CRC-32C so far: the per-layer work runs slot by slot as pages
  // complete, not all at a layer's end (chunk-major, every layer ends during the last chunk: 17
  // GB at once at 128K).
  std::vector<int64_t> complete, sent;
  std::vector<uint32_t> head_crcs;
  std::optional<model::SparseState> device_state;  // the device's capture
  // The prompt's pages once its batch is over, when the device keeps them (PagesOutliveBatch);
  // null during the batch (CopyPages) and on devices that do not.
  std::shared_ptr<const PromptPages> pages;
  std::vector<int32_t> prompt;
  std::vector<float> logits;
  std::vector<model::TokenLogprobs> prompt_logprobs;  // when the request asks for them
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
    if (ring != nullptr) (void)ring->WaitAll(absl::Now() + engine->options_.transfer_timeout);
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
  if (request.sampling().has_prompt_logprobs() && !device_->ComputesPromptLogprobs()) {
    return absl::FailedPreconditionError(
        "prompt logprobs (echo with logprobs) are computed by prefill nodes on the host's cores; "
        "this prefill node runs its forward on a GPU, which does not compute them yet");
  }
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
  j->engine = this;
  j->request = &request;
  j->cancelled = cancelled;
  j->t_start = t_start;
  j->n = n;
  j->geo = geo;
  j->per_head = per_head;
  j->cb = cb;
  j->page_ids = std::move(page_ids);
  j->arena_base = kv.arena_base_address();
  j->remote_page_bytes = kv.page_bytes();
  j->page_target = std::move(page_target);
  j->state_target = std::move(state_target);
  j->meta_target = std::move(meta_target);
  if (valid.want_meta) j->meta_extents = request.page_meta_target();
  j->want_meta = valid.want_meta;
  j->sampling = sampling;
  j->who = who;
  j->targets = std::move(connected);

  // 3. Forward, sending each piece of a layer as it completes, through the staging ring: a slot
  // holds a run of pages of every KV head, so consecutive reserved page ids coalesce into one put.
  j->ppl = geo.pages_per_layer(n);
  j->kv_bytes = static_cast<uint64_t>(j->ppl) * cb * shape.num_layers;
  if (j->want_meta) {
    j->meta_layer_bytes = transfer::PageMetaLayerBytes(geo, n);
    j->meta_bytes = j->meta_layer_bytes * shape.num_layers;
  }
  const uint64_t page_of_each_head = static_cast<uint64_t>(shape.num_kv_heads) * cb;
  j->ring_bytes = StagingRingBytes(options_, geo, n);
  // Four slots in flight at least (one staging while three are on the link), whole pages each.
  j->slot_pages = std::max<int64_t>(1, static_cast<int64_t>(j->ring_bytes / (4 * page_of_each_head)));
  j->crc = kv.checksum_algorithm() == v1::CHECKSUM_ALGORITHM_CRC32C;
  j->checksums.assign(shape.num_layers, 0);
  if (j->want_meta) j->meta_checksums.assign(shape.num_layers, 0);
  if (device_->PagesOutliveBatch()) {  // else a slice of HostStaging (RunDeviceBatch)
    j->owned_ring.reset(new uint8_t[j->ring_bytes]);
    j->owned_meta.resize(j->meta_bytes);
    FLUXION_RETURN_IF_ERROR(AttachStaging(*j, j->owned_ring.get(), j->owned_meta.data()));
  }
  j->submitted = std::make_unique<Submitted>(options_.transfer_timeout);
  j->complete.assign(shape.num_layers, 0);
  j->sent.assign(shape.num_layers, 0);
  j->head_crcs.assign(shape.num_layers * shape.num_kv_heads, 0);
  j->prompt.assign(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
  return job;
}

// Submits pages [p0, p1) of every KV head of `layer` of `j` from `slot` (PackPageRange's
// layout), one batch per range written; the handles go to `writes`, also on an error.
absl::Status PrefillEngine::SubmitPages(
    Job& j, int layer, int64_t p0, int64_t p1, const uint8_t* slot,
    std::vector<std::unique_ptr<transfer::TransferHandle>>* writes) const {
  std::vector<std::vector<transfer::BlockCopy>> copies(j.targets.size());
  const int64_t count = p1 - p0;
  for (int64_t h = 0; h < shape_.num_kv_heads; ++h) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t idx = layer * j.ppl + h * j.per_head + p;
      copies[j.page_target[idx]].push_back({j.arena_base + j.page_ids[idx] * j.remote_page_bytes,
                                            slot + (h * count + p - p0) * j.cb, j.cb});
    }
  }
  return WriteEach(j, copies, writes);
}

// Submits the page-metadata blocks of layers [l0, l1) of `j`: stream bytes
// [l0 * block, l1 * block) split across the page_meta_target extents they fall in.
absl::Status PrefillEngine::SubmitMeta(Job& j, int64_t l0, int64_t l1) const {
  const v1::PageMetaTarget& mt = j.meta_extents;
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
    Job& j, const std::vector<std::vector<transfer::BlockCopy>>& per_target,
    std::vector<std::unique_ptr<transfer::TransferHandle>>* writes) const {
  for (size_t t = 0; t < per_target.size(); ++t) {
    if (per_target[t].empty()) continue;
    absl::StatusOr<std::unique_ptr<transfer::TransferHandle>> h =
        transport_->Write(*j.targets[t], per_target[t]);
    if (!h.ok()) return Annotate(h.status(), j.who);
    j.submitted->Note();
    writes->push_back(std::move(*h));
  }
  return absl::OkStatus();
}

absl::Status PrefillEngine::WriteEach(
    Job& j, const std::vector<std::vector<transfer::BlockCopy>>& per_target) const {
  std::vector<std::unique_ptr<transfer::TransferHandle>> writes;
  absl::Status s = WriteEach(j, per_target, &writes);
  for (auto& h : writes) j.submitted->Add(std::move(h));
  return s;
}

absl::Status PrefillEngine::CheckCancelled(const Job& j, int layer) const {
  if (!j.cancelled()) return absl::OkStatus();
  return absl::CancelledError(absl::StrCat("prefill of request '", j.request->request_id(),
                                           "' aborted at layer ", layer + 1));
}

// The device's report of `j`'s rows [.., end) of `layer`: checks for cancellation and sends the
// pages the rows completed. An error takes the request out of its batch; with pages that outlive
// the batch and others in it, the request is answered right here (its Landing shares the job), so
// that it does not wait for the others' forward.
absl::Status PrefillEngine::OnRows(Job& j, int layer, int64_t end) const {
  absl::Status s = CheckCancelled(j, layer);
  if (s.ok()) s = SendCompleted(j, layer, end);
  if (!s.ok() && j.early_handoff != nullptr && !j.replied) {
    j.forward = s;
    j.t_compute_end = Clock::now();
    (*j.early_handoff)(j.index, std::make_unique<Landing>(j.self.lock(), FinishCompute(j)));
    j.replied = true;
  }
  return s;
}

absl::Status PrefillEngine::SendCompleted(Job& j, int layer, int64_t end) const {
  // Pages whose every row is computed (the last one once the prompt ends).
  j.complete[layer] = end == j.n ? j.per_head : end / j.geo.page_tokens;
  if (!options_.layerwise) return absl::OkStatus();  // all of it from the Landing's drain
  return Pump(j, /*drain=*/false);
}

// Stages and submits the computed pages not sent yet, layer by layer, a slot at a time. Without
// `drain` it stops at the first slot the ring has no room for: those pages wait where they were
// computed (the model's cache, HBM) for a later call, and the compute goes on. With `drain` it
// waits for room (this request's own oldest writes), up to the transfer lease per slot.
absl::Status PrefillEngine::Pump(Job& j, bool drain) const {
  const int64_t hkv = shape_.num_kv_heads;
  for (int layer = 0; layer < shape_.num_layers; ++layer) {
    while (j.sent[layer] < j.complete[layer]) {
      const int64_t p0 = j.sent[layer];
      const int64_t p1 = std::min(j.complete[layer], p0 + j.slot_pages);
      absl::StatusOr<uint8_t*> slot = j.ring->TryAcquire(hkv * (p1 - p0) * j.cb);
      if (!slot.ok()) return Annotate(slot.status(), absl::StrCat(j.who, "KV writes failed: "));
      if (*slot == nullptr) {
        if (!drain) {
          deferred_.fetch_add(1, std::memory_order_relaxed);
          return absl::OkStatus();
        }
        drain_waits_.fetch_add(1, std::memory_order_relaxed);
        FLUXION_RETURN_IF_ERROR(CheckCancelled(j, layer));
        absl::Status room = j.ring->WaitOldest(absl::Now() + options_.transfer_timeout);
        if (!room.ok()) return Annotate(room, absl::StrCat(j.who, "KV writes did not complete: "));
        continue;
      }
      FLUXION_RETURN_IF_ERROR(Stage(j, layer, p0, p1, *slot));
      std::vector<std::unique_ptr<transfer::TransferHandle>> writes;
      absl::Status submitted = SubmitPages(j, layer, p0, p1, *slot, &writes);
      j.ring->Commit(std::move(writes));  // what was submitted holds the slot, also on an error
      slots_.fetch_add(1, std::memory_order_relaxed);
      FLUXION_RETURN_IF_ERROR(submitted);
      j.sent[layer] = p1;
      if (p1 == j.per_head) FLUXION_RETURN_IF_ERROR(FinishLayer(j, layer));
    }
  }
  return absl::OkStatus();
}

// Fills `slot` with pages [p0, p1) of every KV head of `layer` and their records (from the
// device during the batch, from the prompt's kept pages after it), then hashes them while the
// slot is warm.
absl::Status PrefillEngine::Stage(Job& j, int layer, int64_t p0, int64_t p1, uint8_t* slot) const {
  uint8_t* records = j.want_meta ? j.meta + layer * j.meta_layer_bytes : nullptr;
  if (j.pages != nullptr) {
    FLUXION_RETURN_IF_ERROR(j.pages->Copy(layer, p0, p1, slot, records));
  } else {
    FLUXION_RETURN_IF_ERROR(device_->CopyPages(j.device_index, layer, p0, p1, slot, records));
  }
  if (j.crc) {
    const int64_t hkv = shape_.num_kv_heads, count = p1 - p0;
    for (int64_t h = 0; h < hkv; ++h) {
      uint32_t& crc = j.head_crcs[layer * hkv + h];
      crc = transfer::Crc32cExtend(crc, slot + h * count * j.cb, static_cast<size_t>(count) * j.cb);
    }
  }
  return absl::OkStatus();
}

// Every page of `layer` is staged: its checksum, and its page records' block.
absl::Status PrefillEngine::FinishLayer(Job& j, int layer) const {
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
    FLUXION_RETURN_IF_ERROR(SubmitMeta(j, layer, layer + 1));
  }
  if (options_.layer_delay > absl::ZeroDuration()) absl::SleepFor(options_.layer_delay);
  return absl::OkStatus();
}

absl::Status PrefillEngine::AttachStaging(Job& j, uint8_t* ring, uint8_t* meta) const {
  j.ring_memory = ring;
  j.meta = j.want_meta ? meta : nullptr;
  FLUXION_ASSIGN_OR_RETURN(
      j.ring_reg, transport_->Register({j.ring_memory, j.ring_bytes}, {/*remote_write=*/false}));
  j.ring = std::make_unique<StagingRing>(j.ring_memory, j.ring_bytes);
  if (j.want_meta) {
    FLUXION_ASSIGN_OR_RETURN(
        j.meta_reg, transport_->Register({j.meta, j.meta_bytes}, {/*remote_write=*/false}));
  }
  return absl::OkStatus();
}

std::vector<std::unique_ptr<PrefillEngine::Job>> PrefillEngine::PrepareAll(
    absl::Span<const v1::PrefillRequest* const> requests,
    absl::Span<const std::function<bool()>> cancelled, const Handoff& reply) const {
  std::vector<std::unique_ptr<Job>> jobs;
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::StatusOr<std::unique_ptr<Job>> job = Prepare(*requests[i], cancelled[i]);
    if (!job.ok()) {
      reply(i, std::make_unique<Landing>(nullptr, job.status()));
      continue;
    }
    (*job)->index = i;
    jobs.push_back(*std::move(job));
  }
  return jobs;
}

// The batch's requests through one device forward (on the GPU their rows packed into shared
// chunks). The device calls back with each piece of a request once it is computed (OnRows): its
// cancellation is checked, then what fits its ring is sent. A request that fails leaves the batch.
void PrefillEngine::RunOnDevice(absl::Span<Job* const> jobs) const {
  std::vector<DevicePrompt> prompts;
  const Clock::time_point t_compute = Clock::now();
  for (size_t k = 0; k < jobs.size(); ++k) {
    Job& j = *jobs[k];
    j.device_index = k;
    j.t_compute = t_compute;
    const v1::SamplingParams& sp = j.request->sampling();
    prompts.push_back({j.prompt, j.geo.page_tokens, j.want_meta, j.request->has_sparse_target(),
                       j.cancelled,
                       sp.has_prompt_logprobs() ? static_cast<int32_t>(sp.prompt_logprobs()) : -1});
  }
  absl::StatusOr<std::vector<absl::StatusOr<DevicePrefillResult>>> r = device_->RunBatch(
      prompts, [this, jobs](size_t k, int layer, int64_t, int64_t end) -> absl::Status {
        return OnRows(*jobs[k], layer, end);
      });
  for (size_t k = 0; k < jobs.size(); ++k) {
    Job& j = *jobs[k];
    absl::StatusOr<DevicePrefillResult> one = r.ok() ? std::move((*r)[k]) : r.status();
    if (!one.ok()) {
      if (j.forward.ok()) j.forward = one.status();  // OnRows may have set (and answered) it
      if (!j.replied) j.t_compute_end = Clock::now();
      continue;
    }
    j.logits = std::move(one->logits);
    j.prompt_logprobs = std::move(one->prompt_logprobs);
    j.device_state = std::move(one->state);
    j.pages = std::move(one->pages);
    j.t_compute_end = one->forward_end;
  }
}

// The device path: the requests that pass validation share one pinned buffer (each its ring,
// then its page records) and one forward; each is answered once its writes landed.
void PrefillEngine::RunDeviceBatch(absl::Span<const v1::PrefillRequest* const> requests,
                                   absl::Span<const std::function<bool()>> cancelled,
                                   const Handoff& reply) const {
  // One batch at a time from preparation to the last reply: batches share the device's pinned
  // staging, and pages still to send stay in HBM only until the next batch runs. Each Finish
  // drains and waits, so the Landing handed over is already done.
  std::lock_guard<std::mutex> lock(device_mu_);
  std::vector<std::unique_ptr<Job>> jobs = PrepareAll(requests, cancelled, reply);
  if (jobs.empty()) return;
  size_t staging = 0;
  for (const auto& j : jobs) staging += StagingSlice(j->ring_bytes, j->meta_bytes);
  absl::StatusOr<uint8_t*> memory = device_->HostStaging(staging);
  std::vector<Job*> ready;
  size_t offset = 0;
  for (auto& j : jobs) {
    absl::Status attached = memory.status();
    if (attached.ok()) {
      attached = AttachStaging(*j, *memory + offset, *memory + offset + j->ring_bytes);
      offset += StagingSlice(j->ring_bytes, j->meta_bytes);
    }
    if (!attached.ok()) {
      reply(j->index, std::make_unique<Landing>(nullptr, attached));
      continue;
    }
    ready.push_back(j.get());
  }
  if (ready.empty()) return;
  RunOnDevice(ready);
  for (Job* j : ready) reply(j->index, std::make_unique<Landing>(nullptr, Finish(*j)));
}

StagingStats PrefillEngine::staging_stats() const {
  return {slots_.load(std::memory_order_relaxed), deferred_.load(std::memory_order_relaxed),
          drain_waits_.load(std::memory_order_relaxed)};
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::Finish(Job& j) const {
  return Land(&j, FinishCompute(j));
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::FinishCompute(Job& j) const {
  const v1::PrefillRequest& request = *j.request;
  const v1::KvTarget& kv = request.kv_target();
  // Every error below is returned without waiting for the writes already submitted: Land waits
  // for them before the reply goes out ("stopped writing before we say so"). Pages the ring had
  // no room for yet go now as far as it has, the rest from Land's drain.
  if (!j.forward.ok()) return j.forward;
  if (options_.layerwise) FLUXION_RETURN_IF_ERROR(Pump(j, /*drain=*/false));

  // 4. The sparse state, into the room reserved for it.
  v1::PrefillResponse response;
  Clock::time_point t_state_end = j.t_compute_end;
  if (j.cancelled()) {  // the capture below is not interruptible: do not start it for nothing
    return absl::CancelledError(absl::StrCat("prefill of request '", request.request_id(),
                                             "' aborted after the forward"));
  }
  if (request.has_sparse_target()) {
    const v1::SparseStateTarget& st = request.sparse_target();
    if (!j.device_state.has_value()) {
      return absl::InternalError("the prefill device captured no sparse state for this request");
    }
    std::optional<model::SparseState> state = std::move(j.device_state);
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
  if (j.sampling.penalties.repetition != 1.0) sampler.SetPrompt(j.prompt);
  const int32_t first = sampler.Sample(j.logits);
  j.t_all_computed = Clock::now();

  response.set_first_token_id(static_cast<uint32_t>(first));
  if (sampler.last_logprobs().has_value()) {
    proto::TokenLogprobsToProto(*sampler.last_logprobs(), response.mutable_first_token_logprobs());
  }
  for (const model::TokenLogprobs& l : j.prompt_logprobs) {
    proto::TokenLogprobsToProto(l, response.add_prompt_logprobs());
  }
  response.set_prompt_tokens(static_cast<uint32_t>(j.n));
  response.set_checksum_algorithm(kv.checksum_algorithm());
  response.set_kv_bytes_written(j.kv_bytes);  // the checksums once Land has staged every page
  v1::PrefillTiming* timing = response.mutable_timing();
  timing->set_compute_us(MicrosBetween(j.t_compute, j.t_compute_end));
  timing->set_sparse_state_us(MicrosBetween(j.t_compute_end, t_state_end));
  return response;
}

absl::StatusOr<v1::PrefillResponse> PrefillEngine::Land(Job* j,
                                                        absl::StatusOr<v1::PrefillResponse> computed) {
  if (j == nullptr) return computed;  // refused before anything was submitted
  // The pages still waiting for ring room (all of them when not sending layer by layer).
  const absl::Status drained = computed.ok() ? j->engine->Pump(*j, /*drain=*/true) : absl::OkStatus();
  absl::Status landed = j->ring->WaitAll(absl::Now() + j->engine->options_.transfer_timeout);
  if (absl::Status s = j->submitted->WaitAll(); landed.ok()) landed = s;
  if (!computed.ok()) return computed;
  if (!drained.ok()) return drained;
  if (!landed.ok()) return Annotate(landed, absl::StrCat(j->who, "KV writes did not complete: "));
  if (j->crc) {
    for (uint64_t c : j->checksums) computed->add_layer_checksums(c);
  }
  if (j->want_meta) {
    v1::PageMetaSummary* meta = computed->mutable_page_meta();
    meta->set_format_version(transfer::kPageMetaVersion);
    meta->set_bytes_written(j->meta_bytes);
    if (j->crc) {
      for (uint64_t c : j->meta_checksums) meta->add_layer_checksums(c);
    }
  }
  j->t_first_submit = j->submitted->first_submit();
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
  if (!device_->PagesOutliveBatch()) return RunDeviceBatch(requests, cancelled, handoff);
  // Each request with staging of its own and its pages kept by the device: answered as soon as its
  // compute is over, its writes still landing (the Landing shares the job and its pages).
  std::vector<std::shared_ptr<Job>> jobs;
  std::vector<Job*> ready;
  for (std::unique_ptr<Job>& job : PrepareAll(requests, cancelled, handoff)) {
    std::shared_ptr<Job> shared = std::move(job);
    shared->self = shared;
    ready.push_back(shared.get());
    jobs.push_back(std::move(shared));
  }
  if (jobs.empty()) return;
  // In a batch, one that fails leaves it and is answered at once (OnRows); alone it simply ends.
  if (jobs.size() > 1) {
    for (auto& j : jobs) j->early_handoff = &handoff;
  }
  RunOnDevice(ready);
  for (auto& j : jobs) {  // the rest, in order; FinishCompute answers a failed forward with its error
    if (!j->replied) handoff(j->index, std::make_unique<Landing>(j, FinishCompute(*j)));
    j->replied = true;
  }
}

}  // namespace fluxion::prefill
