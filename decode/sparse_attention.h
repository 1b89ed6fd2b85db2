// A request's attention over its host KV pages under a sparse policy: the decode-side
// implementation of model::SequenceAttention. Prompt K/V arrive from a full-attention prefill
// (here: copied from a DenseAttention, rounded to bf16 as the pages store them; in the served
// system they land over UCX); every decode step appends its K/V to the pages and attends the rows
// the policy selects, per KV head with its whole GQA group, through the CPU paged kernel.
//
// Thread-compatible (one request, one driver thread).
#ifndef FLUXION_DECODE_SPARSE_ATTENTION_H_
#define FLUXION_DECODE_SPARSE_ATTENTION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "decode/paged_kv.h"
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
  // attention backend (decode/paged_batch_attention.h): the policy decides (BeginDecode), the
  // caller attends exactly what it decided, the policy completes the step (FinishDecode).
  //
  // BeginDecode appends the token's K/V at pos0 (== the layer's length) and has the policy select
  // the spans of every KV head: plan() then holds them, in the CSR form of a PagedDecodeProblem
  // with one request (kv head h attends spans[indptr[h] .. indptr[h + 1])).
  // q: [num_heads][head_dim], k and v: [num_kv_heads][head_dim]. InvalidArgument for a layer out
  // of range or a position that does not continue the pages; ResourceExhausted when the arena
  // has no page for the token (nothing appended, no plan).
  absl::Status BeginDecode(int layer, int64_t pos0, const float* q, const float* k,
                           const float* v);
  struct Plan {
    std::vector<int64_t> indptr;            // [num_kv_heads + 1]
    std::vector<kernels::PageSpan> spans;   // every head's spans, head after head
  };
  const Plan& plan() const { return plan_; }
  // After the caller attended plan() into out [num_heads][head_dim] and lse [num_heads]
  // (natural base): merges the policy's estimate of the rows it skipped, if it gives one, and
  // lets it observe the step. q as given to BeginDecode. REQUIRES: a successful BeginDecode
  // since the last FinishDecode.
  void FinishDecode(const float* q, float* out, float* lse);

  // Attended and scored rows summed over every decode step, layer and KV head so far.
  const sparse::SelectionStats& stats() const { return stats_; }
  // Fraction of available context rows attended by decode steps (the budget actually spent).
  double attended_fraction() const {
    return stats_.context > 0 ? static_cast<double>(stats_.rows_attended) / stats_.context : 0.0;
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
                  const sparse::PolicyConfig& config, std::unique_ptr<sparse::SparsePolicy> policy);

  static inline std::atomic<uint64_t> next_id_{1};
  const uint64_t id_;
  model::AttentionShape shape_;
  sparse::PolicyConfig config_;
  std::unique_ptr<PagedKv> kv_;
  std::unique_ptr<sparse::SparsePolicy> policy_;
  sparse::SelectionStats stats_;
  // The decode step in progress (BeginDecode .. FinishDecode).
  Plan plan_;
  int plan_layer_ = 0;
  int64_t plan_context_ = 0;
  // Scratch, reused across steps.
  std::vector<kernels::PageSpan> spans_;
  std::vector<float> lse_, head_lse_, rest_out_, rest_lse_;
  std::vector<kernels::cpu::PagedAttentionTask> tasks_;  // [kv_head]
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SPARSE_ATTENTION_H_
