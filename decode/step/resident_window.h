// The device-resident part of each request's KV in the hybrid decode step (ALGORITHMS.md §2.4,
// docs/EXECUTOR.md section 7): per (request, layer, KV head) the first `sink_tokens` tokens and a
// ring of the last `window_tokens`. The device attends these rows densely every step while the
// CPU attends the rest of what the policy selected over the host pages; the two partial states
// merge by log-sum-exp. A streaming head (a plan of sinks + window only) never touches the CPU.
//
// Ring: token t < sink_tokens sits in row t; token t >= sink_tokens in row
// sink_tokens + (t - sink_tokens) % window_tokens, so the last window_tokens tokens always
// occupy distinct rows and a step's append overwrites exactly the token that left the window.
// At context c the valid rows are [0, resident_rows(c)), resident_rows(c) =
// min(c, sink) + min(window, max(0, c - sink)).
//
// Memory: q/k/v/out of AppendAndAttend are in the memory the window runs on (the DenseOps's:
// device memory for CUDA, host memory for the host implementation); the states merged in by
// MergeHostStates are in host memory. Operations may run asynchronously in issue order (the CUDA
// implementation uses the DenseOps's stream); errors are sticky and returned by Sync().
//
// Selection metadata: for policies that rank blocks by Quest's page bounds (quest, fixed_*), the
// window also keeps each slot's page bounds and scores every block per step where the bounds
// live, so the CPU reads one score per block instead of 2 x head_dim bounds per page (at 8B shapes
// and 128K tokens the CPU scan reads 2.1 GB per step: 79.7 ms against 30.7 with device scores,
// bench/results/decode-block-scores-zerocopy-8b-h200-20261202.json). For quest and fixed_* it
// also ranks them (RankBlocks), and the CPU reads only the
// picks; Fluxion ranks its own candidates from the page scores on the CPU.
//
// Implementations: NewHostResidentWindow (here: host memory and the CPU kernel, the stand-in on
// which the hybrid executor's split, placement and merge are tested without a GPU) and the CUDA
// one (decode/device/cuda_resident_window.h).
//
// Thread-compatible: the executor's thread drives it.
#ifndef FLUXION_DECODE_STEP_RESIDENT_WINDOW_H_
#define FLUXION_DECODE_STEP_RESIDENT_WINDOW_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/policy.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/attention.h"

namespace fluxion::decode {

struct WindowShape {
  int64_t num_layers = 0;
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  float scale = 0.0f;        // softmax scale
  int64_t sink_tokens = 4;
  int64_t window_tokens = 64;
  int64_t max_requests = 64;  // slots
  int64_t max_rows = 64;      // rows (requests) of one step
  // Selection metadata (ResidentWindow::ScoreBlocks): the host KV's page size, and the longest
  // context whose page bounds a slot keeps (0: none, so no row is ever scored here).
  int64_t page_tokens = 16;
  int64_t max_context_tokens = 0;
  // Device selection (ResidentWindow::SelectRows): how many slots keep their K as compact rows
  // (kernels/compact_keys.h) for contexts up to max_context_tokens; 0: none. A request admitted
  // while every such place is taken (or longer) is selected on the CPU by its policy instead.
  int64_t compact_slots = 0;

  int64_t max_pages() const { return (max_context_tokens + page_tokens - 1) / page_tokens; }

  int64_t rows_per_head() const { return sink_tokens + window_tokens; }
  int64_t resident_rows(int64_t context) const {
    return std::min(context, sink_tokens) +
           std::min(window_tokens, std::max<int64_t>(0, context - sink_tokens));
  }
  int64_t ring_row(int64_t token) const {
    return token < sink_tokens ? token : sink_tokens + (token - sink_tokens) % window_tokens;
  }
};

// InvalidArgument naming the first bad field (non-positive sizes, heads not a multiple of KV
// heads, a window of no rows).
absl::Status ValidateWindowShape(const WindowShape& shape);

// The window for a model's attention with `max_requests` slots (and rows per step), resident
// sinks and window of the default policy config (every policy attends at least those).
WindowShape WindowShapeFor(const model::AttentionShape& attention, int64_t max_requests);

// Calls fn(t) for every resident token of a context of `tokens` tokens: the sinks, then the
// window.
void ForEachResidentToken(const WindowShape& shape, int64_t tokens,
                          absl::FunctionRef<void(int64_t)> fn);

// Where a step's block scores go (ResidentWindow::ScoreBlocks): row i keeps page bounds for
// blocks of block[i] tokens (0: none), and when scored this step (blocks[i] > 0) its
// [num_kv_heads][blocks[i]] scores sit at offset[i] of one array of `total` floats (offset -1:
// not scored).
struct StepScorePlan {
  std::vector<int32_t> block;
  std::vector<int64_t> blocks;
  std::vector<int64_t> offset;
  int64_t total = 0;
  int64_t max_blocks = 0;  // the largest blocks[i]
};

// Where a step's device picks go (ResidentWindow::SelectRows): pair j = row * num_kv_heads + h
// asks picks[j] (k < 0: its policy selects itself); `count[j]` picks (0 when the row keeps no
// compact rows or nothing is asked) lie at offset[j] of one array of `total` positions.
// row_picked[i]: row i's policy asked and the row keeps compact rows, so its picks are made.
struct StepPickPlan {
  std::vector<kernels::CompactPick> picks;  // k clamped to the span, offsets set
  std::vector<int64_t> offset;
  std::vector<int32_t> count;
  std::vector<uint8_t> row_picked;
  int64_t total = 0;
  int64_t max_span = 0;  // the largest end - begin of a pair with k > 0
};
// Lays out `asked` (rows * num_kv_heads entries) for rows whose compact[i] is set.
void PlanPicks(absl::Span<const kernels::CompactPick> asked, absl::Span<const int32_t> compact,
               int64_t num_kv_heads, StepPickPlan* plan);

// The slot bookkeeping both implementations share: which slots hold a request, how many tokens
// each holds and the block size its rows are scored at, and the checks of Admit and BeginStep
// (their errors as the interface states). Thread-safe: a request may be admitted on another
// thread while a step runs over other slots.
class WindowSlots {
 public:
  explicit WindowSlots(const WindowShape& shape)
      : shape_(shape),
        tokens_(shape.max_requests, -1),
        score_block_(shape.max_requests, 0),
        compact_(shape.max_requests, -1),
        compact_used_(shape.compact_slots, 0) {}
  // The tokens `kv` holds, after checking it has the window's shape and even layers, and that a
  // score block size is a positive multiple of the window's page size (0: none).
  absl::StatusOr<int64_t> CheckAdmit(const PagedKv& kv, int64_t score_block_tokens) const;
  // A free slot, now holding `tokens`, scored at `score_block_tokens` when the window keeps
  // metadata for that many tokens (else 0); ResourceExhausted when none is free.
  absl::StatusOr<int> Take(int64_t tokens, int64_t score_block_tokens, bool compact_keys);
  void Release(int slot);
  // The block size slot `slot`'s rows are scored at now (0: not scored).
  int64_t score_block(int slot) const {
    absl::MutexLock lock(&mu_);
    return score_block_[slot];
  }
  // Where slot `slot` keeps compact rows (an index below shape.compact_slots), or -1: none.
  int32_t compact_index(int slot) const {
    absl::MutexLock lock(&mu_);
    return compact_[slot];
  }
  absl::Status CheckStep(absl::Span<const int> slots, absl::Span<const int64_t> positions) const;
  // Every slot of the step holds one more token (every layer takes the step's), and the step's
  // score plan (rows with score[i] false, or all when `score` is empty, keep their bounds but get
  // no scores): a slot whose context outgrows max_context_tokens stops being scored for good
  // (its bounds could not follow).
  // *compact: each row's compact index this step (-1: none), as compact_index after the step's
  // token (a context that outgrows max_context_tokens loses its compact rows for good).
  void Advance(absl::Span<const int> slots, absl::Span<const uint8_t> score,
               StepScorePlan* plan, std::vector<int32_t>* compact);

 private:
  const WindowShape shape_;
  mutable absl::Mutex mu_;
  std::vector<int64_t> tokens_ ABSL_GUARDED_BY(mu_);       // [slot]: tokens held, -1 when free
  std::vector<int64_t> score_block_ ABSL_GUARDED_BY(mu_);  // [slot]: 0 when not scored
  std::vector<int32_t> compact_ ABSL_GUARDED_BY(mu_);      // [slot]: compact index or -1
  std::vector<uint8_t> compact_used_ ABSL_GUARDED_BY(mu_);  // [compact index]
};

class ResidentWindow {
 public:
  virtual ~ResidentWindow() = default;
  virtual const WindowShape& shape() const = 0;

  // Loads the resident rows of the tokens `kv` holds (every layer the same count) into a free
  // slot and returns it. With `score_block_tokens` > 0 (a multiple of shape().page_tokens) the
  // slot also keeps the page bounds of every page of `kv` (its key_min / key_max) and its rows
  // are scored in blocks of that many tokens by ScoreBlocks, while the context fits
  // max_context_tokens (longer: never scored, and the policy scores on the CPU as without a
  // window). ResourceExhausted when every slot is taken; InvalidArgument for a KV of another
  // shape or page size, uneven layers, or a bad block size.
  // With `compact_keys` (a policy that selects on the device, decode/sparse/device_selection.h)
  // the slot also takes one of shape().compact_slots places while one is free and the context
  // fits max_context_tokens (see SelectRows); without, it never takes one, so the places stay
  // for the requests that select from them.
  virtual absl::StatusOr<int> Admit(const PagedKv& kv, int64_t score_block_tokens,
                                    bool compact_keys) = 0;
  // The threads Admit may use inside a step (null, the default: the calling thread). Admission
  // runs inside the step that first holds the request, so every other request of that step
  // waits for it. `pool` must outlive the window.
  virtual void set_cpu_pool(const kernels::cpu::CpuPool* pool) {}
  // Frees a slot (its rows are then garbage). Unknown or free slots are ignored.
  virtual void Release(int slot) = 0;

  // The rows of the next step: row i is slot slots[i], whose token is at positions[i] (so its
  // context becomes positions[i] + 1). score[i] false: row i needs no block scores this step
  // (its policy picks no block yet; its bounds are still kept); empty: every scored slot's row.
  // InvalidArgument for more than max_rows rows, a slot not admitted, or a position that does not
  // continue the slot's tokens.
  virtual absl::Status BeginStep(absl::Span<const int> slots, absl::Span<const int64_t> positions,
                                 absl::Span<const uint8_t> score) = 0;
  absl::Status BeginStep(absl::Span<const int> slots, absl::Span<const int64_t> positions) {
    return BeginStep(slots, positions, {});
  }
  // Layer `layer` of the step: appends each row's K/V to its ring and attends each (row, KV head)
  // group over its resident rows into out [rows][num_heads][head_dim] and the window's own lse.
  // q: [rows][num_heads][head_dim] post-RoPE, k and v: [rows][num_kv_heads][head_dim].
  virtual void AppendAndAttend(int layer, const float* q, const float* k, const float* v,
                               float* out) = 0;
  // Selection metadata, layer `layer` of the step, issued before AppendAndAttend with the same
  // q and k: folds each scored row's K into its page's bounds, then scores every block of the
  // row's context for every KV head (Quest's bound, max over the group: the formula of
  // kernels::cpu::QuestBlockBounds). Asynchronous: WaitBlockScores() makes them readable.
  virtual void ScoreBlocks(int layer, const float* q, const float* k) = 0;
  // Waits for the last ScoreBlocks; the first error since the last wait or Sync.
  virtual absl::Status WaitBlockScores() = 0;
  // Row i's scores from the last ScoreBlocks, in host memory (valid until the next one):
  // data == nullptr when the row is not scored; top set when the row is ranked (RankBlocks).
  virtual sparse::ScoredBlocks block_scores(int row) const = 0;
  // Rows whose policy takes a fixed number of top-ranked blocks (quest, fixed_*; their range is
  // sparse::TopBlocksRange): each ScoreBlocks of this step also ranks row i's blocks
  // [ranges[i].first, ranges[i].end) of every KV head where the scores are and keeps the
  // ranges[i].want best (block_scores(i).top), so the CPU reads `want` block numbers per head
  // instead of ranking every block's score (at 8B shapes and 128K tokens that ranking is ~2.6
  // ms of a 17.6 ms step on the CPU:
  // bench/results/decode-rank-{host,device}-8b-128k-h200-20261202.json). Called after
  // BeginStep, for that step; an empty span or want 0 ranks nothing; a range past the row's
  // blocks is clamped to them.
  virtual void RankBlocks(absl::Span<const sparse::ScoredBlocks::Range> ranges) = 0;

  // Device selection (decode/sparse/device_selection.h): a slot admitted while one of
  // shape().compact_slots places is free and its context fits max_context_tokens keeps its K as
  // compact rows (kernels/compact_keys.h), from the host pages at Admit and from each step's K
  // here. Layer `layer` of the step, after ScoreBlocks and before AppendAndAttend, with the same
  // q and k: appends each compact row's K, then picks for every pair j = row * num_kv_heads + h
  // with asked[j].k > 0 the k best rows of [begin, end) by compact score, among the candidates
  // of `masks` where asked[j].mask >= 0 (kernels::CompactCandidate), ascending (CompactTopK's
  // rule), readable after WaitBlockScores in block_scores(row).picks. `masks` is read before the
  // call returns. Called every layer of every step while compact_slots > 0 (the appends keep the
  // rows current); `asked` empty or every k < 0 picks nothing. Asynchronous like ScoreBlocks.
  virtual void SelectRows(int layer, const float* q, const float* k,
                          absl::Span<const kernels::CompactPick> asked,
                          absl::Span<const uint64_t> masks) = 0;

  // Zero-copy reads (ALGORITHMS.md §2.4.6 item 3): the device attends part of the selected host
  // rows itself, reading host pages over PCIe while the CPU reads the rest, so both paths to host
  // memory run at once. MappedView gives the view of `host` pages the device reads (CUDA: the
  // arena pinned by PinArenaForCuda, at its device address), or FailedPrecondition (not pinned)
  // / Unimplemented (a shape the device kernel lacks); the host stand-in reads host memory as is.
  virtual absl::StatusOr<kernels::PagedKvView> MappedView(const kernels::PagedKvView& host) = 0;
  // Layer `layer` of the step, after AppendAndAttend and before MergeHostStates: attends each
  // (row, KV head) pair's spans [indptr[pair], indptr[pair + 1]) of `kv` (a MappedView; indptr
  // [rows * num_kv_heads + 1] and spans in host memory, read before the call returns) with q (as
  // AppendAndAttend's), merged into out by log-sum-exp. Asynchronous like AppendAndAttend.
  virtual void AttendMappedSpans(const kernels::PagedKvView& kv, const int64_t* indptr,
                                 const kernels::PageSpan* spans, int64_t num_spans,
                                 const float* q, float* out) = 0;

  // out := merge(out, host state) by log-sum-exp, per (row, query head): host_out
  // [rows][num_heads][head_dim], host_lse [rows][num_heads] (natural base; -inf: nothing to
  // add), in host memory. Uses the lse AppendAndAttend left for this layer.
  virtual void MergeHostStates(const float* host_out, const float* host_lse, float* out) = 0;
  // Waits for issued work; the first error since the last Sync.
  virtual absl::Status Sync() = 0;
};

// The host implementation: rows in bf16 (as the host pages store them), attended with the CPU
// paged kernel. InvalidArgument for a bad shape or one the CPU kernel does not support.
absl::StatusOr<std::unique_ptr<ResidentWindow>> NewHostResidentWindow(const WindowShape& shape,
                                                                     int64_t page_tokens);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_RESIDENT_WINDOW_H_
