// Random weights of a model shape made straight in a DenseOps's memory, without a checkpoint or a
// host copy of the whole model: for timing real shapes (Llama-3.1-8B is 16 GB in bf16 and 32 GB
// as the CPU model's fp32) on a machine where neither a file nor the host copy fits the budget.
// Each matrix is generated on the host (a counter-based generator, in parallel over `pool`) and
// handed to the backend one at a time, so host memory holds one matrix at most.
//
// The values are uniform with variance 1/in per product (norm weights 1), so activations stay of
// order one through the layers: the numbers mean nothing, the shapes and the memory traffic are
// the model's. Never for quality measurements.
#ifndef FLUXION_MODEL_RANDOM_PARAMS_H_
#define FLUXION_MODEL_RANDOM_PARAMS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/config.h"
#include "model/dense_ops.h"
#include "model/layer.h"

namespace fluxion::model {

// Errors: the backend's (ResourceExhausted when its memory runs out).
absl::StatusOr<ModelParams> RandomParams(const ModelConfig& config, DenseOps& ops, uint64_t seed,
                                         const kernels::cpu::CpuPool* pool);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_RANDOM_PARAMS_H_
