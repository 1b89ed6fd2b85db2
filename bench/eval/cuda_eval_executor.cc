#include "bench/eval/cuda_eval_executor.h"

#include <cuda_runtime.h>

#include <utility>

#include "bench/eval/task_eval.h"
#include "common/status_macros.h"
#include "decode/step/step_executor_factory.h"
#include "model/cuda_dense_ops.h"

namespace fluxion::eval {

absl::StatusOr<std::unique_ptr<decode::StepExecutor>> NewCudaHybridEvalExecutor(
    const model::Model* model, const kernels::cpu::CpuPool* pool) {
  // One slot: the harness decodes one request at a time, and the executor gives a slot back at
  // the first step that no longer lists its request. Block scores from the window's page
  // bounds, as served; the CPU reads every host row (zero-copy shares are checked by
  // decode/device/cuda_resident_window_test.cc, and the eval's arena is not pinned).
  decode::StepExecutorOptions options;
  options.device = decode::StepDevice::kCuda;
  options.cuda.max_requests = 1;
  options.cuda.max_context_tokens = kEvalMaxContextTokens;
  options.cuda.page_tokens = kEvalPageTokens;
  options.cuda.compact_slots = 1;  // +device labels pick on the GPU, as served
  return decode::NewStepExecutor(model, pool, /*arena=*/nullptr, options);
}

}  // namespace fluxion::eval
