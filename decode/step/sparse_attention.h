// A request's attention over its host KV pages under a sparse policy: the decode-side
// implementation of model::SequenceAttention. Prompt K/V arrive from a full-attention prefill
// (here: copied from a DenseAttention, rounded to bf16 as the pages store them; in the served
// system they land over UCX); every decode step appends its K/V to the pages and attends the rows
// the policy selects, per KV head with its whole GQA group, through the CPU paged kernel.
//
// Thread-compatible (one request, one driver thread).
#ifndef FLUXION_DECODE_STEP_SPARSE_ATTENTION_H_
#define FLUXION_DECODE_STEP_SPARSE_ATTENTION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/policy.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "model/attention.h"
#include "model/dense_attention.h"

namespace fluxion::decode {

// One decode step of one (layer, KV head) under `policy`: select rows, attend them with the CPU
// kernel, merge the policy's estimate of the skipped rows if it gives one, and let the policy
// observe the step. out: [group][head_dim]; lse: [group]. `spans` is scratch and holds the
// selection afterwards.
void RunPolicyStep(sparse::SparsePolicy& policy, const sparse::SelectionInput& in,
                   std::vector<kernels::PageSpan>* spans, sparse::SelectionStats* stats,
                   float* out, float* lse);

class SparseAttention : public model::SequenceAttention {
 public:
  // Copies every layer's prefilled K/V from `prefilled` into pages of `arena` (which must outlive
  // the result). ResourceExhausted when the arena is short of pages (nothing kept);
  // InvalidArgument for shapes the CPU kernel does not support or a bad policy config.
  // `state` is the prefill's sparse state (model/sparse_state.h), shared by every policy decoding
  // from the same prefill; when null and `prefilled` recorded tail queries, it is captured here.
  static absl::StatusOr<std::unique_ptr<SparseAttention>> FromDense(
      KvArena* arena, const model::AttentionShape& shape, int64_t page_tokens,
      const model::DenseAttention& prefilled, const sparse::PolicyConfig& policy,
      const model::SparseState* state = nullptr);

  // Decodes over `kv`, whose prompt pages are already filled (PagedKv::Adopt: the served path,
  // where a prefill node wrote them). `state` as for FromDense; null for policies that need none.
  static absl::StatusOr<std::unique_ptr<SparseAttention>> FromPages(
      std::unique_ptr<PagedKv> kv, const model::AttentionShape& shape,
      const sparse::PolicyConfig& policy, const model::SparseState* state);

  // n == 1 (decode): the policy's rows. n > 1 (more prompt): causal full attention over pages.
  // A decode step here runs the three phases below, attending the plan with the CPU kernel on
  // the calling thread's OpenMP team.
  absl::Status Forward(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                       const float* v, float* out) override;

  // One layer of a decode step in phases, so that a batch's attention can be one problem for an
  // attention backend (decode/step/paged_batch_attention.h): the policy decides (Select), the
  // caller attends exactly what it decided, the policy completes the step (Finish).
  //
  //   AppendToken(layer, pos0, k, v)   the token's K/V into the pages (pos0 == the layer's length)
  //   SelectUnit(u, q) for every unit  the policy's spans of each KV head: head_spans(h)
  //   (the caller attends head_spans(h) into out/lse of head h's query group)
  //   FinishUnit(u, q, out, lse)       the policy's estimate of the skipped rows merged in, and
  //                                    the policy observes the step
  //
  // A unit is a KV head: one policy object per KV head when the policy's heads are independent
  // (PolicyTraits::heads_independent), else one object for every head, which supports
  // concurrent units. Different units of one request may run in parallel; the phases of a unit
  // run in that order, one step at a time.
  //
  // q: [num_heads][head_dim], k and v: [num_kv_heads][head_dim]; out [num_heads][head_dim] and
  // lse [num_heads] (natural base) of the whole request (a unit touches its heads' rows only).
  // AppendToken: InvalidArgument for a layer out of range or a position that does not continue
  // the pages; ResourceExhausted when the arena has no page for the token (nothing appended).
  absl::Status AppendToken(int layer, int64_t pos0, const float* k, const float* v);
  int units() const { return static_cast<int>(shape_.num_kv_heads); }
  // `scored`: this layer's block scores of the request when computed elsewhere (the hybrid
  // step's device); policies that rank page bounds at that block size use them.
  // `budget_scale`: SelectionInput::budget_scale (the hybrid step's stall guard; 1: the policy's
  // budget).
  // `scored.picks`: the device selection's picks of this layer (ResidentWindow::SelectRows).
  void SelectUnit(int unit, const float* q, const sparse::ScoredBlocks& scored = {},
                  double budget_scale = 1.0);
  // What the policy of `unit` asks the device to pick at `layer` of the step whose token is at
  // `position` (SparsePolicy::DevicePick, with the guard's shift and `budget_scale` as SelectUnit
  // will apply them); nullopt when it selects itself. Before the layer's AppendToken.
  std::optional<sparse::DeviceAsk> DevicePick(int unit, int layer, int64_t position,
                                              double budget_scale) const;
  const std::vector<kernels::PageSpan>& head_spans(int kv_head) const {
    return head_spans_[step_layer_ & 1][kv_head];
  }
  void FinishUnit(int unit, const float* q, float* out, float* lse);

  // The hybrid step's split of FinishUnit (decode/step/hybrid_batch_attention.h), which takes the
  // policies' observation off the layer's critical path:
  //
  //   CompleteUnit(u, q, out, lse) for every unit   the policy's estimate of the skipped rows
  //                                                 merged in (before the layer's merge)
  //   DeferObserve(q)                               keeps what the observation needs
  //   ... the next layer's AppendToken ...
  //   ObservePending(u) for every unit              the policy observes the step, then makes
  //                                                 what it can of the next one ahead
  //                                                 (SparsePolicy::PrepareNextStep); units in
  //                                                 parallel, and in parallel with the next
  //                                                 layer's SelectUnit calls
  //   EndObserve()                                  after every ObservePending
  //
  // The policies see the same calls in the same order per (layer, KV head) as with FinishUnit,
  // so they select exactly the same rows. A pending observation must end before its layer (or
  // one of the same parity: the policies keep scratch per layer parity) selects again:
  // AppendToken and Forward run whatever is pending there themselves, on the calling thread.
  void CompleteUnit(int unit, const float* q, float* out, float* lse);
  void DeferObserve(const float* q);
  bool observe_pending() const { return pending_.active; }
  void ObservePending(int unit);
  void EndObserve() { pending_.active = false; }

  // The online error guard (decode/sparse/error_guard.h), when the policy config enables it:
  // whether this step checks any KV head of the current layer exactly, and the check itself,
  // after the layer's output is final (every unit finished, the skipped rows' estimates and a
  // hybrid step's resident part merged in): `out` is this request's [num_heads][head_dim] output
  // of the layer in host memory. Each due head is attended over every row, its e_h computed with
  // the policy config's output projection and reported to the guard, which moves budget for the
  // next steps. One thread per request; different requests may check in parallel.
  bool GuardDue() const;
  void CheckLayer(const float* q, const float* out);
  // What the guard did so far (zeros without one).
  sparse::GuardStats guard_stats() const;
  const sparse::ErrorGuard* guard() const { return guard_.get(); }

  // AppendToken and every SelectUnit; every FinishUnit (one thread).
  absl::Status BeginDecode(int layer, int64_t pos0, const float* q, const float* k,
                           const float* v);
  void FinishDecode(const float* q, float* out, float* lse);

  // Attended and scored rows summed over every decode step, layer and KV head so far.
  sparse::SelectionStats stats() const;
  // Fraction of available context rows attended by decode steps (the budget actually spent).
  double attended_fraction() const {
    const sparse::SelectionStats s = stats();
    return s.context > 0 ? static_cast<double>(s.rows_attended) / s.context : 0.0;
  }
  const PagedKv& kv() const { return *kv_; }
  // Gives the pages back to the caller (e.g. a benchmark decoding the same context under several
  // policies); the attention must not be used afterwards.
  std::unique_ptr<PagedKv> TakeKv() { return std::move(kv_); }
  const sparse::PolicyConfig& policy_config() const { return config_; }
  // Unique in the process for its lifetime and never reused (an executor keys per-request state
  // by it; an address can be reused by the next request).
  uint64_t id() const { return id_; }

 private:
  SparseAttention(const model::AttentionShape& shape, std::unique_ptr<PagedKv> kv,
                  const sparse::PolicyConfig& config,
                  std::vector<std::unique_ptr<sparse::SparsePolicy>> policies);
  // The policies for `config` (one, or one per KV head), each prepared for its heads of every
  // layer from `state` (may be null).
  static absl::StatusOr<std::vector<std::unique_ptr<sparse::SparsePolicy>>> MakePolicies(
      const PagedKv& kv, const model::AttentionShape& shape, const sparse::PolicyConfig& config,
      const model::SparseState* state);
  // The policy object of `unit` (its KV head).
  sparse::SparsePolicy& PolicyOf(int unit) const {
    return *policies_[policies_.size() == 1 ? 0 : unit];
  }
  sparse::SelectionInput Input(int kv_head, const float* q) const;
  // Every pending unit's ObservePending, then EndObserve, on the calling thread.
  void FlushObserve();

  static inline std::atomic<uint64_t> next_id_{1};
  const uint64_t id_;
  model::AttentionShape shape_;
  sparse::PolicyConfig config_;
  std::unique_ptr<PagedKv> kv_;
  std::vector<std::unique_ptr<sparse::SparsePolicy>> policies_;  // [1] or [num_kv_heads]
  std::vector<sparse::SelectionStats> head_stats_;               // [num_kv_heads]
  // The decode step in progress, per layer parity (a layer's plan stays for its deferred
  // observation while the next layer selects): [layer & 1][kv_head].
  std::vector<std::vector<kernels::PageSpan>> head_spans_[2];
  // What each unit's last SelectUnit of a layer parity gave the policy besides the query.
  struct UnitBudget {
    double scale = 1.0, shift = 0.0;
  };
  std::vector<UnitBudget> unit_budget_[2];  // [layer & 1][unit]
  int step_layer_ = 0;
  int64_t step_context_ = 0;
  // The observation DeferObserve kept for ObservePending.
  struct PendingObserve {
    bool active = false;
    int layer = 0;
    int64_t context = 0;
    std::vector<float> q;  // the layer's queries, [num_heads][head_dim]
  } pending_;
  // Scratch per unit (units may run in parallel), reused across steps.
  std::vector<std::vector<float>> rest_out_, rest_lse_;  // [unit]
  // Scratch of Forward (one thread).
  std::vector<kernels::PageSpan> spans_;
  std::vector<float> lse_, head_lse_;
  std::vector<kernels::cpu::PagedAttentionTask> tasks_;  // [kv_head]
  // The error guard (null when off) and CheckLayer's scratch.
  std::unique_ptr<sparse::ErrorGuard> guard_;
  std::vector<kernels::PageSpan> check_spans_;
  std::vector<float> check_out_, check_lse_, check_layer_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_SPARSE_ATTENTION_H_
