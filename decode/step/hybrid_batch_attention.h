// The attention of the hybrid decode step (docs/EXECUTOR.md section 7; ALGORITHMS.md §2.4): per
// layer, the resident window (resident_window.h: sinks + a ring of recent tokens, on the device)
// is appended to and attended densely for the whole batch, while on the CPU every request's
// policy plans its step over the host pages (SparseAttention::AppendToken and SelectUnit), the
// rows of the plan that are not resident are attended as ONE problem by the CPU attention
// backend, each policy completes its step on that partial state (CompleteUnit: its estimate of
// skipped rows merges in), and the CPU partials merge into the window's output by log-sum-exp. A
// plan of sinks + window only (a streaming head) has no CPU rows. The policies observe the
// layer's step (ObservePending: history tables, and the next step's query-independent picks)
// beside the next layer's selections, not before the merge, when those selections leave threads
// idle (at batch 1 a layer's 8 selections leave half of a 16-thread pool idle, and the
// observation is no input of the layer's output); when the selections fill the pool, right
// after each unit's completion (ObserveInFinish; measured both ways: EXECUTOR.md section 7).
//
// Exactness: the resident rows are the first min(c, sink) and the last
// min(window, c - sink) tokens of a context of c; every policy's plan contains them when its
// sink_tokens >= the window's sink_tokens and its local_tokens >= window_tokens (the executor
// checks at admission). Since a plan's spans are in token order, those rows are exactly the
// plan's first and last rows: the CPU part is the plan with that many rows trimmed off each end,
// no page lookup needed. The result is the plan's attention, merged in another order.
//
// CPU lane: with a CpuLane (set_cpu_lane; decode/step/cpu_lane.h), the CPU phase of every layer --
// from the host K/V append to the policies' completion, everything that runs on the pool between
// "q/k/v on the host" and "CPU partials merged" -- runs on the thread serving the lane, after the
// phases submitted before it, so that two attentions driven from two threads (the ping-pong executor's
// micro-batches, ping_pong_step_executor.h) never run their CPU phases at once and all of them
// start their parallel regions from one thread, while the device work each issued before
// proceeds. The wait for the device's block scores then comes before the lane (without a lane it
// overlaps the host append).
//
// Thread-compatible: the executor's thread drives it (the lane is the only state shared with
// another attention).
#ifndef FLUXION_DECODE_STEP_HYBRID_BATCH_ATTENTION_H_
#define FLUXION_DECODE_STEP_HYBRID_BATCH_ATTENTION_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "decode/step/cpu_lane.h"
#include "decode/step/paged_batch_attention.h"
#include "decode/step/resident_window.h"
#include "decode/step/sparse_attention.h"
#include "kernels/attention_backend.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/decode_step.h"
#include "model/dense_ops.h"
#include "model/model.h"

namespace fluxion::decode {

// Appends to `out` the spans of `plan` ([begin, end) of one head's spans, in token order) with
// the first `front` and the last `back` rows removed (spans cut where needed). REQUIRES: the
// spans hold at least front + back rows.
void TrimSpans(const kernels::PageSpan* begin, const kernels::PageSpan* end, int64_t front,
               int64_t back, std::vector<kernels::PageSpan>* out);

// Appends the first `front_rows` rows of spans [begin, end) to `front` and the rest to `rest`
// (a span cut where needed), both in token order.
void SplitSpans(const kernels::PageSpan* begin, const kernels::PageSpan* end, int64_t front_rows,
                std::vector<kernels::PageSpan>* front, std::vector<kernels::PageSpan>* rest);

// The share of each (request, KV head) pair's host rows the device reads itself (zero-copy),
// rounded to whole rows: the pair's first rows.
int64_t DeviceRows(int64_t host_rows, double device_share);

// What a hybrid step's attention did, summed over layers since the last ResetCounters.
struct HybridCounters {
  int64_t resident_rows = 0;  // rows the window attended
  int64_t host_rows = 0;      // rows the CPU attended over host pages
  int64_t mapped_rows = 0;    // host rows the device read itself (zero-copy)
  int64_t host_pairs = 0;     // (request, KV head) pairs with any host rows
  int64_t pairs = 0;          // all (request, KV head) pairs
  int64_t layers_observed_in_finish = 0;  // layers whose observation ran in their finish phase
  // Wall time of the attention's phases on the driving thread, in seconds. to_host includes
  // waiting for the layer's projections on the device (the copy waits for them).
  double to_host_s = 0;  // q/k/v to the host
  double plan_s = 0;     // append to host pages + policy selection: the three below
  double append_s = 0;   //   the token's K/V into the host pages (AppendToken)
  double scores_s = 0;   //   waiting for the device's block scores
  double select_s = 0;   //   the policies' selection (SelectUnit)
  double host_s = 0;     // the CPU's attention over the non-resident rows: the two below
  double host_prep_s = 0;  //   its problem, and the device's zero-copy share split off, launched
  double host_kernel_s = 0;  //   the CPU backend's run
  double finish_s = 0;   // policies' estimates of skipped rows (CompleteUnit), and their
                         // observation when ObserveInFinish (else it runs beside the next
                         // layer's selections, in select_s)
  double merge_s = 0;    // CPU partials to the device and merged
  double guard_s = 0;    // the error guard's exact checks (decode/sparse/error_guard.h)
  double lane_wait_s = 0;  // waiting for the CPU lane (another micro-batch's CPU phase)
};

// to += from, field by field (the ping-pong executor's two pipelines as one step's counters).
void AddCounters(const HybridCounters& from, HybridCounters* to);

class HybridBatchAttention : public model::BatchAttention {
 public:
  // `window`, `cpu_backend` (host memory), `pool` (may be null) and `ops` (the DenseOps the
  // step's rows live in) must outlive this.
  HybridBatchAttention(ResidentWindow* window, kernels::AttentionBackend* cpu_backend,
                       const kernels::cpu::CpuPool* pool, model::DenseOps* ops,
                       const model::AttentionShape& shape)
      : window_(window), backend_(cpu_backend), pool_(pool), ops_(ops), shape_(shape) {}

  // The next step's requests (row i = seqs[i], attentions[i]). The window's BeginStep must have
  // been called with the same rows. All must outlive the step.
  void SetBatch(absl::Span<model::Sequence* const> seqs,
                absl::Span<SparseAttention* const> attentions) {
    seqs_ = seqs;
    attentions_ = attentions;
  }

  // Errors name the request: its BeginDecode's, the backend's, or the window's (checked after
  // the last layer). An error fails the step as a whole.
  absl::Status Attend(const model::LayerAttentionIo& io) override;

  // The share of each pair's host rows the device reads from pinned host pages while the CPU
  // reads the rest (0: the CPU reads all); used when the window maps the pages
  // (ResidentWindow::MappedView), else the CPU reads all.
  void set_device_read_share(double share) { device_share_ = share; }

  // The lane the CPU phase of every layer takes (must outlive this); null (the default): none.
  void set_cpu_lane(CpuLane* lane) { lane_ = lane; }
  CpuLane* cpu_lane() const { return lane_; }
  // The share of every policy's middle budget the next steps spend (SelectionInput::
  // budget_scale; the stall guard's, decode/step/stall_guard.h). Default 1.
  void set_budget_scale(double scale) { budget_scale_ = scale; }

  const HybridCounters& counters() const { return counters_; }
  void ResetCounters() { counters_ = {}; }

 private:
  // One (request, KV head) pair's part of the layer, planned on the pool right after its
  // selection (so the per-span work is spread over the threads, not left to the driving thread:
  // at 8B shapes a serial pass is 1-4 ms of a step): the plan without its
  // resident rows, split into the device's zero-copy share and the CPU's rest.
  struct PairPlan {
    std::vector<kernels::PageSpan> trimmed;  // scratch: the non-resident rows before the split
    std::vector<kernels::PageSpan> device, cpu;
    int64_t resident_rows = 0, host_rows = 0, device_rows = 0;
  };
  // Whether some request's error guard has a check due this layer.
  bool GuardDue() const;
  // Each (request, KV head)'s device pick for this layer into asked_ (k -1: its policy selects
  // itself), for ResidentWindow::SelectRows.
  void AskDevicePicks(const model::LayerAttentionIo& io);
  // The error guard's exact checks of the layer for the requests due (SparseAttention::
  // CheckLayer), on the merged output (copied to the host first when it is on a device).
  absl::Status GuardChecks(const model::LayerAttentionIo& io, const float* q);
  // Pair `pair` (request i, KV head h): its plan trimmed and split (device_share when `mapped`).
  void PlanPair(const model::LayerAttentionIo& io, int64_t i, int64_t h, bool mapped);
  // The pairs' CPU parts as one host problem over io's rows, and the device's parts as CSR lists
  // (device_indptr_, device_spans_); counts the rows.
  absl::Status AssembleHostProblem(const model::LayerAttentionIo& io, const float* q,
                                   const kernels::PagedKvView& view,
                                   kernels::PagedDecodeProblem* p);

  class PhaseClock;
  // The layer's CPU phase (see the header comment), on the thread serving the lane when there is
  // an open one; `clock` laps its parts.
  absl::Status CpuPhase(const model::LayerAttentionIo& io, const float* q, const float* k,
                        const float* v, PhaseClock* clock);
  // Whether the layer's observations run in its finish phase rather than beside the next
  // layer's `selections` selections: when those fill the pool's threads.
  bool ObserveInFinish(int64_t selections) const;

  ResidentWindow* const window_;
  kernels::AttentionBackend* const backend_;
  const kernels::cpu::CpuPool* const pool_;
  model::DenseOps* const ops_;
  const model::AttentionShape shape_;
  absl::Span<model::Sequence* const> seqs_;
  absl::Span<SparseAttention* const> attentions_;
  HybridCounters counters_;
  // Scratch, grown to the largest step seen.
  std::vector<float> q_, k_, v_;  // host copies when the rows are in device memory
  std::vector<float> host_out_, host_lse_;
  std::vector<float> out_host_;  // the layer's output on the host for the guard's checks
  std::vector<absl::Status> statuses_;
  std::vector<RequestUnit> units_;
  std::vector<kernels::CompactPick> asked_;  // [rows * num_kv_heads], AskDevicePicks's
  std::vector<uint64_t> asked_masks_;         // their candidates' words (CompactPick::mask)
  std::vector<RequestUnit> pending_units_;  // the previous layer's deferred observations
  std::vector<PairPlan> pair_plans_;  // [request * num_kv_heads + head]
  std::vector<int64_t> indptr_;
  std::vector<kernels::PageSpan> spans_;
  std::vector<int64_t> device_indptr_;
  std::vector<kernels::PageSpan> device_spans_;
  double device_share_ = 0;
  double budget_scale_ = 1.0;
  CpuLane* lane_ = nullptr;
  std::vector<std::byte> workspace_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_HYBRID_BATCH_ATTENTION_H_
