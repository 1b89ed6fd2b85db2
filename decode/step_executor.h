// The decode step executor: one call gives every running request one token. The scheduler
// (batch_scheduler.h) owns the batch and the requests' lifecycles; the executor owns how a step
// is computed. docs/EXECUTOR.md describes the seam.
//
//   CpuStepExecutor         the batched step on the CPU: every weight read once per step for the
//                           whole batch (model::Model::DecodeStep: DenseOps halves over stacked
//                           rows, attention per request through its SequenceAttention). The
//                           serving default.
//   PerRequestStepExecutor  one Model::Forward per request (what the decode node did before the
//                           batched seam): kept as the baseline `fluxion bench decode` measures
//                           against in the same run, and as a fallback switch.
// The hybrid CPU-GPU executor (issue 14) implements the same interface.
//
// Thread-compatible: the scheduler thread calls Step().
#ifndef FLUXION_DECODE_STEP_EXECUTOR_H_
#define FLUXION_DECODE_STEP_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "model/model.h"

namespace fluxion::kernels::cpu {
class CpuPool;
}

namespace fluxion::decode {

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual absl::string_view name() const = 0;
  // Feeds tokens[i] to seqs[i] (at position seqs[i]->length()) and writes the next-token logits
  // of request i into row i of `logits` [seqs.size()][vocab]. (*statuses)[i] is OK when request
  // i advanced by one token and its row is valid, else its error (its cache is then unspecified
  // and the scheduler ends it). An executor whose step can only fail as a whole gives every
  // request that error.
  // REQUIRES: seqs.size() == tokens.size() > 0, no sequence listed twice.
  virtual void Step(absl::Span<model::Sequence* const> seqs, absl::Span<const int32_t> tokens,
                    std::vector<float>* logits, std::vector<absl::Status>* statuses) = 0;
};

// `model` (and `pool`, when not null) must outlive the executor.
std::unique_ptr<StepExecutor> NewCpuStepExecutor(const model::Model* model,
                                                 const kernels::cpu::CpuPool* pool = nullptr);
std::unique_ptr<StepExecutor> NewPerRequestStepExecutor(const model::Model* model);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_EXECUTOR_H_
