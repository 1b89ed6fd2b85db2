#include "bench/eval/cuda_eval_executor.h"

#include <cuda_runtime.h>

#include <utility>

#include "bench/eval/task_eval.h"
#include "common/status_macros.h"
#include "decode/cuda_resident_window.h"
#include "decode/hybrid_step_executor.h"
#include "decode/resident_window.h"
#include "model/cuda_dense_ops.h"

namespace fluxion::eval {

absl::StatusOr<std::unique_ptr<decode::StepExecutor>> NewCudaHybridEvalExecutor(
    const model::Model* model, const kernels::cpu::CpuPool* pool) {
  // One slot: the harness decodes one request at a time, and the executor gives a slot back at
  // the first step that no longer lists its request. Block scores from the window's page
  // bounds, as served; the CPU reads every host row (zero-copy shares are checked by
  // decode/cuda_resident_window_test.cc, and the eval's arena is not pinned).
  decode::CudaHybridOptions options;
  options.max_requests = 1;
  options.max_context_tokens = kEvalMaxContextTokens;
  options.page_tokens = kEvalPageTokens;
  options.compact_slots = 1;  // +device labels pick on the GPU, as served
  return decode::NewCudaHybridStepExecutor(model, pool, options);
}

}  // namespace fluxion::eval
