// The prefill node's work for one request: validate it against this node's model and layout,
// connect to the decode node's arena (transfer/), run the model's forward over the prompt with
// full attention on a PrefillDevice (prefill/prefill_device.h: the host's cores, CpuPrefillDevice,
// or the GPU, DevicePrefill), and as each piece of a layer completes write its KV pages into the
// pages the decode node reserved, so the transfer of layer l overlaps the compute of layers l+1..
// (the transport's progress thread moves the bytes while the device computes). Pages pass through
// a bounded staging ring (prefill/staging_ring.h); what it has no room for waits where the device
// keeps it (the prompt's cache, HBM) and goes as earlier writes complete. With each completed
// layer also goes its per-page selection metadata (transfer/page_meta.h), when the request has a
// page_meta_target, made by the device with the pages. Then the sparse state the device captured
// is written into the room reserved for it, what is left is sent, every write is waited for, and
// the first token is sampled.
//
// "Any reply means the prefill node stopped writing" (prefill.proto): Run() returns only after
// every batch it submitted has completed or failed, also when cancelled between layers.
//
// Thread-safe: Run()/RunBatch() may be called from several threads (each call owns its buffers;
// the device runs one batch at a time); the service runs one batch at a time so that it gets every
// core.
#ifndef FLUXION_PREFILL_PREFILL_ENGINE_H_
#define FLUXION_PREFILL_PREFILL_ENGINE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/types/span.h"

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fluxion/v1/prefill.pb.h"
#include "model/model.h"
#include "prefill/prefill_device.h"
#include "prefill/staging_ring.h"
#include "transfer/kv_pages.h"
#include "transfer/transport.h"

namespace fluxion::prefill {

struct PrefillEngineOptions {
  // Send each layer as soon as it is computed (true) or everything after the last layer (false:
  // the baseline the benchmark compares against).
  bool layerwise = true;
  // Bound on waiting for the writes to land once submitted (the transfer's lease).
  absl::Duration transfer_timeout = absl::Seconds(30);
  // The forward runs over the prompt in pieces of this many tokens (the model chunks long inputs
  // at 512 anyway): cancellation is checked, and completed pages are sent, after every piece of
  // every layer, so a smaller piece cancels sooner and starts sending earlier.
  int64_t piece_tokens = 512;
  // Fault injection for tests: sleep this long after each layer's send is submitted, so a test
  // can kill the process or cancel the request mid-transfer.
  absl::Duration layer_delay = absl::ZeroDuration();
  // Host memory each request's pages pass through (prefill/staging_ring.h), capped at the
  // prompt's KV and raised to one page of every KV head. What does not fit waits in the model's
  // cache or HBM and goes as writes complete: the compute never waits on the link. The default
  // holds a 2K-token chunk through all 32 layers of Llama-3.1-8B (8 MiB a layer) with room to
  // spare; at 128K the whole prompt would be 16 GiB.
  uint64_t staging_ring_bytes = uint64_t{512} << 20;
};

// The staging ring of a `tokens`-token prompt: options.staging_ring_bytes, capped at the prompt's
// KV and raised to one page of every KV head.
uint64_t StagingRingBytes(const PrefillEngineOptions& options, const transfer::KvPageGeometry& geo,
                          int64_t tokens);
// What the device path pins for such a prompt: its ring, then its pages' selection records, as one
// 4 KiB-aligned slice (PrefillDevice::HostStaging); a batch takes one slice per request.
uint64_t DeviceStagingBytes(const PrefillEngineOptions& options,
                            const transfer::KvPageGeometry& geo, int64_t tokens);

// How the staging ring kept up (counts since the engine started): slots staged and sent, and the
// times the ring had no room: during the compute (the pages waited in the model's cache or HBM;
// the compute did not wait) and in a Landing's drain (a request waited for its own writes). Many
// of the first mean the link is slower than the compute or the ring too small for it
// (--staging-ring-mib).
struct StagingStats {
  uint64_t slots = 0;
  uint64_t deferred = 0;
  uint64_t drain_waits = 0;
};

class PrefillEngine {
 public:
  // `model` and `transport` must outlive the engine. `layout` is what this node serves. The
  // engine computes on the host's cores: a CpuPrefillDevice of its own (prefill/
  // cpu_prefill_device.h) over `model`, in pieces of options.piece_tokens.
  PrefillEngine(const model::Model* model, transfer::Transport* transport,
                const fluxion::v1::ModelLayout& layout, const PrefillEngineOptions& options);
  // The same engine computing on an accelerator (prefill/prefill_device.h; the GPU's is
  // prefill/device_prefill.h), which must outlive it: a batch's requests run through one device
  // forward (PrefillDevice::RunBatch: on the GPU their rows packed into shared chunks), each
  // (chunk, layer) piece of each request sent as soon as its pages reach the host, the sparse
  // state captured on the device.
  PrefillEngine(PrefillDevice* device, transfer::Transport* transport,
                const fluxion::v1::ModelLayout& layout, const PrefillEngineOptions& options);

  // Runs `request`. `cancelled` is polled between layers; once it returns true the call stops
  // computing, waits for writes already submitted, and returns Cancelled. Errors:
  // InvalidArgument (bad ids, sampling, extents), FailedPrecondition (layout, protocol version,
  // transport kind, checksum algorithm), ResourceExhausted (sparse-state room too small),
  // Unavailable (the decode node is gone), DeadlineExceeded (writes did not land in time).
  absl::StatusOr<fluxion::v1::PrefillResponse> Run(const fluxion::v1::PrefillRequest& request,
                                                   const std::function<bool()>& cancelled) const;

  // Several requests through one batched forward (model::Model::ForwardBatch): piece p of every
  // request still computing is stacked into one forward, each request keeping its own sends after
  // every piece of every layer, checksums, sparse state and cancellation checks. `reply(i, ...)`
  // is called exactly once per request, from this thread, after that request's writes completed
  // or failed: a request rejected by validation at once, one that fails or is cancelled
  // mid-batch as soon as it left the batch (the others go on unharmed), the rest after the
  // forward. One request alone runs exactly as Run(). REQUIRES: cancelled.size() ==
  // requests.size().
  using Reply = std::function<void(size_t, absl::StatusOr<fluxion::v1::PrefillResponse>)>;
  void RunBatch(absl::Span<const fluxion::v1::PrefillRequest* const> requests,
                absl::Span<const std::function<bool()>> cancelled, const Reply& reply) const;

  // --- Waiting for the writes off the compute thread (docs/FAULTS.md, "Findings") ---
  // A request whose compute is over and whose writes may still be in flight to its decode node.
  // It owns the request's buffers until the writes stopped. Wait() sends the pages the staging
  // ring had no room for yet, blocks until every write landed, failed or the lease
  // (transfer_timeout) ran out, and returns the reply; destroying a Landing
  // that was not waited for waits too ("any reply means the prefill node stopped writing").
  class Landing;
  using Handoff = std::function<void(size_t, std::unique_ptr<Landing>)>;
  // RunBatch, but `handoff(i, landing)` is called, once per request and from this thread, as soon
  // as request i's compute is over, without waiting for its writes: the caller waits on each
  // Landing where it likes, so a decode node that does not take its writes (link down, stopped)
  // holds only its own requests, not this thread and the requests behind them. RunBatch is this
  // with reply(i, landing->Wait()).
  void RunBatchDeferred(absl::Span<const fluxion::v1::PrefillRequest* const> requests,
                        absl::Span<const std::function<bool()>> cancelled,
                        const Handoff& handoff) const;

  const fluxion::v1::ModelLayout& layout() const { return layout_; }
  StagingStats staging_stats() const;

 private:
  struct Job;
  absl::StatusOr<std::unique_ptr<Job>> Prepare(const fluxion::v1::PrefillRequest& request,
                                               const std::function<bool()>& cancelled) const;
  // Prepares each request (its index in `requests` kept); one that fails is answered at once.
  std::vector<std::unique_ptr<Job>> PrepareAll(
      absl::Span<const fluxion::v1::PrefillRequest* const> requests,
      absl::Span<const std::function<bool()>> cancelled, const Handoff& reply) const;
  absl::Status SubmitPages(Job& j, int layer, int64_t p0, int64_t p1, const uint8_t* slot,
                           std::vector<std::unique_ptr<transfer::TransferHandle>>* writes) const;
  absl::Status SubmitMeta(Job& j, int64_t l0, int64_t l1) const;
  // Writes copies[t] into j.targets[t] for every t with copies, one batch each: the handles to
  // `writes`, or (without) to j.submitted.
  absl::Status WriteEach(Job& j, const std::vector<std::vector<transfer::BlockCopy>>& copies,
                         std::vector<std::unique_ptr<transfer::TransferHandle>>* writes) const;
  absl::Status WriteEach(Job& j, const std::vector<std::vector<transfer::BlockCopy>>& copies) const;
  absl::Status OnRows(Job& j, int layer, int64_t end) const;
  absl::Status CheckCancelled(const Job& j, int layer) const;
  // Notes the pages of `layer` that rows [0, end) completed and sends what the ring has room for.
  absl::Status SendCompleted(Job& j, int layer, int64_t end) const;
  absl::Status Pump(Job& j, bool drain) const;
  absl::Status Stage(Job& j, int layer, int64_t p0, int64_t p1, uint8_t* slot) const;
  absl::Status FinishLayer(Job& j, int layer) const;
  // Staging of the request's own, or its slice of the device's HostStaging.
  absl::Status AttachStaging(Job& j, uint8_t* ring, uint8_t* meta) const;
  void RunDeviceBatch(absl::Span<const fluxion::v1::PrefillRequest* const> requests,
                      absl::Span<const std::function<bool()>> cancelled,
                      const Handoff& reply) const;
  void RunOnDevice(absl::Span<Job* const> jobs) const;
  absl::StatusOr<fluxion::v1::PrefillResponse> Finish(Job& j) const;
  // Finish is Land(&j, FinishCompute(j)): waits for the writes, as every direct reply must.
  // FinishCompute is the reply as far as the compute goes (an error, or the response without the
  // transfer's timings) and does not wait: RunBatchDeferred hands it to a Landing.
  absl::StatusOr<fluxion::v1::PrefillResponse> FinishCompute(Job& j) const;
  // Waits for `j`'s writes, then the final reply: `computed`'s error, the writes' error, or the
  // response with its transfer timings.
  static absl::StatusOr<fluxion::v1::PrefillResponse> Land(
      Job* j, absl::StatusOr<fluxion::v1::PrefillResponse> computed);

  std::unique_ptr<PrefillDevice> owned_device_;  // the CPU's, when built from a model
  PrefillDevice* const device_;                   // what computes: owned_device_ or the caller's
  const model::ModelConfig config_;
  const model::AttentionShape shape_;
  transfer::Transport* const transport_;
  const fluxion::v1::ModelLayout layout_;
  const PrefillEngineOptions options_;
  // Devices whose pages do not outlive a batch: one batch at a time (their shared HostStaging).
  mutable std::mutex device_mu_;
  mutable std::atomic<uint64_t> slots_{0}, deferred_{0}, drain_waits_{0};  // StagingStats
};

class PrefillEngine::Landing {
 public:
  Landing(std::shared_ptr<Job> job, absl::StatusOr<fluxion::v1::PrefillResponse> computed);
  ~Landing();
  Landing(const Landing&) = delete;
  Landing& operator=(const Landing&) = delete;
  // Once; REQUIRES: not called before.
  absl::StatusOr<fluxion::v1::PrefillResponse> Wait();

 private:
  std::shared_ptr<Job> job_;  // null: nothing was submitted (refused before connecting)
  absl::StatusOr<fluxion::v1::PrefillResponse> computed_;
  bool waited_ = false;
};

}  // namespace fluxion::prefill

#endif  // FLUXION_PREFILL_PREFILL_ENGINE_H_
