// The one place that decides how a decode step runs: the batched CPU step, or the hybrid step on
// CUDA device 0 (docs/EXECUTOR.md sections 7 and 8: one pipeline, or two ping-pong
// micro-batches). `fluxion decode` (decode/serving/decode_worker.h) and the eval harness build
// their executors here; the CUDA building blocks (decode/device/cuda_resident_window.h) decide
// nothing.
//
// Thread-compatible functions.
#ifndef FLUXION_DECODE_STEP_STEP_EXECUTOR_FACTORY_H_
#define FLUXION_DECODE_STEP_STEP_EXECUTOR_FACTORY_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "decode/kv/kv_arena.h"
#include "decode/step/stall_guard.h"
#include "decode/step/step_executor.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/model.h"

namespace fluxion::decode {

// Where decode steps run.
enum class StepDevice {
  kCpu,   // NewCpuStepExecutor: the batched CPU step
  kCuda,  // the hybrid step: dense halves and the resident window on GPU 0, the rest on the CPU
};
// "cpu" or "cuda"; InvalidArgument for any other name.
absl::StatusOr<StepDevice> ParseStepDevice(absl::string_view name);

// The hybrid step's settings.
struct CudaHybridOptions {
  int64_t max_requests = 128;      // window slots (both micro-batches' together)
  int64_t max_context_tokens = 0;  // page bounds per slot for block scores (0: the CPU scores)
  // Requests whose K the window keeps as compact rows for device selection (WindowShape::
  // compact_slots; CompactSlotsFor sizes it from an HBM budget); 0: the CPU selects.
  int64_t compact_slots = 0;
  int64_t page_tokens = 16;       // of the host KV pages
  double device_read_share = 0;   // HybridStepExecutor::set_device_read_share, in [0, 1]
  int micro_batches = 1;          // 1 or 2 (ping-pong; EXECUTOR.md section 8 says when it pays)
  StallGuardOptions stall_guard;  // dynamic degradation (decode/step/stall_guard.h); off by default
};

// What NewStepExecutor builds: `cuda` applies with StepDevice::kCuda only.
struct StepExecutorOptions {
  StepDevice device = StepDevice::kCpu;
  CudaHybridOptions cuda;
};

// InvalidArgument for hybrid settings no executor serves: micro_batches other than 1 or 2, two
// micro-batches of fewer than 2 slots, a read share outside [0, 1], a bad stall guard.
absl::Status ValidateCudaHybridOptions(const CudaHybridOptions& options);

// Builds the executor `options` names. kCpu: NewCpuStepExecutor. kCuda: the hybrid step executor
// on CUDA device 0 (weights uploaded to CudaDenseOps in bf16, a CUDA resident window of
// max_requests slots, the host part on `pool`), or with two micro-batches the ping-pong executor
// over two such pipelines (each its own CudaDenseOps, half the slots: A ceil, B floor), the
// weights uploaded once. With kCuda and a non-null `arena`, the arena is pinned for the GPU first
// (PinArenaForCuda); when it cannot be, the step still serves with the CPU reading every host row
// (device_read_share 0), and says so on stderr. `model`, `pool` and `arena` must outlive the
// executor. FailedPrecondition when this binary was built without CUDA or there is no device;
// ValidateCudaHybridOptions' errors; the factories' errors.
absl::StatusOr<std::unique_ptr<StepExecutor>> NewStepExecutor(const model::Model* model,
                                                              const kernels::cpu::CpuPool* pool,
                                                              KvArena* arena,
                                                              StepExecutorOptions options);

// The HBM one request of up to `max_context_tokens` takes for its compact rows, in GiB.
double CompactGibPerRequest(const model::AttentionShape& attention, int64_t max_context_tokens);

// How many requests of up to `max_context_tokens` fit their compact rows in `gib` GiB of HBM
// (kernels/compact_keys.h: 132 bytes per token, layer and KV head at head_dim 128), at most
// `max_requests`.
int64_t CompactSlotsFor(const model::AttentionShape& attention, int64_t max_context_tokens,
                        double gib, int64_t max_requests);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_STEP_EXECUTOR_FACTORY_H_
