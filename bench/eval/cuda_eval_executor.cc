#include "bench/eval/cuda_eval_executor.h"

#include <cuda_runtime.h>

#include <utility>

#include "common/status_macros.h"
#include "decode/cuda_resident_window.h"
#include "decode/hybrid_step_executor.h"
#include "decode/resident_window.h"
#include "model/cuda_dense_ops.h"

namespace fluxion::eval {

absl::StatusOr<std::unique_ptr<decode::StepExecutor>> NewCudaHybridEvalExecutor(
    const model::Model* model, const kernels::cpu::CpuPool* pool) {
  // Built from its parts rather than through NewCudaHybridStepExecutor so that only the window's
  // size is chosen here: one slot, since the harness decodes one request at a time and the
  // executor gives a slot back at the first step that no longer lists its request.
  const decode::WindowShape shape =
      decode::WindowShapeFor(model->attention_shape(), /*max_requests=*/1);
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::DenseOps> ops, model::NewCudaDenseOps(0));
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<decode::ResidentWindow> window,
      decode::NewCudaResidentWindow(shape, static_cast<cudaStream_t>(ops->native_stream())));
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<decode::HybridStepExecutor> executor,
      decode::HybridStepExecutor::Create(model, std::move(ops), std::move(window), pool));
  return std::unique_ptr<decode::StepExecutor>(std::move(executor));
}

}  // namespace fluxion::eval
