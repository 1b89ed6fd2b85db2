// The decode step executor: one call gives every running request one token. The scheduler
// (batch_scheduler.h) owns the batch and the requests' lifecycles; the executor owns how a step
// is computed. docs/EXECUTOR.md describes the seam.
//
//   CpuStepExecutor         the batched step on the CPU: every weight read once per step for the
//                           whole batch (model::Model::DecodeStep: DenseOps halves over stacked
//                           rows), and per layer ONE attention problem for the batch built from
//                           the requests' policy plans, computed by the CPU attention backend
//                           over the pool (paged_batch_attention.h). The serving default.
//   PerRequestStepExecutor  one Model::Forward per request (what the decode node did before the
//                           batched seam): kept as the baseline `fluxion bench decode` measures
//                           against in the same run, and as a fallback switch.
// The hybrid CPU-GPU executor (issue 14) implements the same interface.
//
// Thread-compatible: the scheduler thread calls Step().
#ifndef FLUXION_DECODE_STEP_STEP_EXECUTOR_H_
#define FLUXION_DECODE_STEP_STEP_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "decode/step/sparse_attention.h"
#include "model/model.h"
#include "model/sampler.h"

namespace fluxion::kernels::cpu {
class CpuPool;
}

namespace fluxion::decode {

// One request of a step: its sequence (whose length is the input token's position), that
// sequence's attention as the decode node builds it, the input token, and the request's sampler.
struct StepRequest {
  model::Sequence* seq = nullptr;
  SparseAttention* attention = nullptr;  // &seq->attention()
  int32_t token = 0;
  // Draws the next token in StepAndSample; null: the caller wants the row's logits (tests,
  // `fluxion eval`). Step ignores it.
  model::Sampler* sampler = nullptr;
};

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual absl::string_view name() const = 0;
  // The most requests one step can take (0: no limit). The scheduler keeps the rest waiting.
  virtual int64_t max_batch() const { return 0; }
  // Feeds every request its token and writes the next-token logits of request i into row i of
  // `logits` [batch.size()][vocab]. (*statuses)[i] is OK when request i advanced by one token
  // and its row is valid, else its error (its cache is then unspecified and the scheduler ends
  // it). An executor whose step can only fail as a whole gives every request that error.
  // REQUIRES: batch non-empty, no sequence listed twice, attention == &seq->attention().
  virtual void Step(absl::Span<const StepRequest> batch, std::vector<float>* logits,
                    std::vector<absl::Status>* statuses) = 0;
  // The step that samples (the scheduler's): as Step, and for every request i with a sampler
  // whose status is OK, (*tokens)[i] is the token batch[i].sampler drew from its next-token
  // distribution (-1 for the others). Row i of `logits` [batch.size()][vocab] is valid for every
  // request without a sampler; the other rows are unspecified (an executor need not bring them
  // to the host). The default runs Step and samples each row on the host; the hybrid executor
  // copies only the sampler's candidates when their parameters allow (docs/EXECUTOR.md).
  virtual void StepAndSample(absl::Span<const StepRequest> batch, std::vector<int32_t>* tokens,
                             std::vector<float>* logits, std::vector<absl::Status>* statuses);

  // Whether the executor can hold `attention`'s request beside the running ones, reserving what
  // it needs when so (the hybrid executor: a device-selection place for a request whose policy
  // selects from compact keys, so that no such request falls back to the CPU's selection for
  // want of HBM). The scheduler asks before a request joins, keeps it and those behind it
  // waiting on false and asks again later, and calls Forget when the request ends (even if it
  // never joined a step). Asking again for a request that holds its reservation returns true.
  // `attention` (and its KV) must stay alive until Forget returns. Default: always true.
  virtual bool Reserve(const SparseAttention& attention) { return true; }
  virtual void Forget(const SparseAttention& attention) {}
};

// For every request i with a sampler and an OK status, (*tokens)[i] = its sampler's draw from row
// i of logits [batch.size()][vocab]; -1 for the others. (StepAndSample's default.)
void SampleRows(absl::Span<const StepRequest> batch, absl::Span<const float> logits,
                absl::Span<const absl::Status> statuses, std::vector<int32_t>* tokens);

// `model` (and `pool`, when not null) must outlive the executor. Null pool: the calling thread.
std::unique_ptr<StepExecutor> NewCpuStepExecutor(const model::Model* model,
                                                 const kernels::cpu::CpuPool* pool = nullptr);
std::unique_ptr<StepExecutor> NewPerRequestStepExecutor(const model::Model* model);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_STEP_EXECUTOR_H_
