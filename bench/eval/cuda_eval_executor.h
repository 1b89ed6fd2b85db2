// `fluxion eval tasks --device cuda`: the hybrid step executor on CUDA device 0 as the harness
// drives it (one request per step). Built only with CUDA.
#ifndef FLUXION_BENCH_EVAL_CUDA_EVAL_EXECUTOR_H_
#define FLUXION_BENCH_EVAL_CUDA_EVAL_EXECUTOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "decode/step/step_executor.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/model.h"

namespace fluxion::eval {

// The model's weights in bf16 on CudaDenseOps, a CUDA resident window of one slot (sinks and
// window of the default policy config, block scores from its page bounds), the host part of
// every plan on `pool`: the executor `fluxion decode --device cuda` serves with (the CPU reads
// every non-resident row). `model` and `pool` must outlive it.
// FailedPrecondition without a device; the factories' errors.
absl::StatusOr<std::unique_ptr<decode::StepExecutor>> NewCudaHybridEvalExecutor(
    const model::Model* model, const kernels::cpu::CpuPool* pool);

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_CUDA_EVAL_EXECUTOR_H_
