#include "decode/step/step_executor_factory.h"

#include <algorithm>
#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/compact_keys.h"

#ifdef FLUXION_HAVE_CUDA
#include "decode/device/cuda_resident_window.h"
#include "decode/step/hybrid_step_executor.h"
#include "decode/step/ping_pong_step_executor.h"
#endif

namespace fluxion::decode {
namespace {

#ifdef FLUXION_HAVE_CUDA
// Pins the arena so the device reads host rows zero-copy; without the pin the step still serves,
// the CPU reading every host row.
void PinOrReadOnHost(KvArena* arena, CudaHybridOptions* options) {
  if (arena == nullptr) return;
  // Locking a large arena takes a while (64 GiB: 18-32 s on the H200 host): say so.
  std::cerr << "pinning the " << (arena->bytes() >> 20) << " MiB KV arena for the GPU\n";
  if (absl::Status pinned = PinArenaForCuda(arena); !pinned.ok()) {
    std::cerr << "warning: " << pinned << "\n";
    options->device_read_share = 0;
  }
}

// The hybrid step on device 0: one pipeline, or two that ping-pong the batch's halves.
absl::StatusOr<std::unique_ptr<StepExecutor>> NewCudaHybrid(const model::Model* model,
                                                            const kernels::cpu::CpuPool* pool,
                                                            const CudaHybridOptions& options) {
  auto shape_for = [&](int64_t slots, int64_t compact_slots) {
    WindowShape w = WindowShapeFor(model->attention_shape(), slots);
    w.page_tokens = options.page_tokens;
    w.max_context_tokens = options.max_context_tokens;
    w.compact_slots = std::min(slots, compact_slots);
    return w;
  };
  if (options.micro_batches == 1) {
    FLUXION_ASSIGN_OR_RETURN(
        PingPongStepExecutor::Pipeline p,
        NewCudaPipeline(shape_for(options.max_requests, options.compact_slots), 0));
    FLUXION_ASSIGN_OR_RETURN(
        std::unique_ptr<HybridStepExecutor> executor,
        HybridStepExecutor::Create(model, std::move(p.ops), std::move(p.window), pool));
    executor->set_device_read_share(options.device_read_share);
    executor->set_stall_guard(options.stall_guard);
    return std::unique_ptr<StepExecutor>(std::move(executor));
  }
  FLUXION_ASSIGN_OR_RETURN(
      PingPongStepExecutor::Pipeline a,
      NewCudaPipeline(shape_for((options.max_requests + 1) / 2, (options.compact_slots + 1) / 2),
                      0));
  FLUXION_ASSIGN_OR_RETURN(
      PingPongStepExecutor::Pipeline b,
      NewCudaPipeline(shape_for(options.max_requests / 2, options.compact_slots / 2), 0));
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<PingPongStepExecutor> executor,
                           PingPongStepExecutor::Create(model, std::move(a), std::move(b), pool,
                                                        CudaPingPongOptions(0)));
  executor->set_device_read_share(options.device_read_share);
  for (int h = 0; h < 2; ++h) executor->pipeline(h).set_stall_guard(options.stall_guard);
  return std::unique_ptr<StepExecutor>(std::move(executor));
}
#endif  // FLUXION_HAVE_CUDA

}  // namespace

absl::StatusOr<StepDevice> ParseStepDevice(absl::string_view name) {
  if (name == "cpu") return StepDevice::kCpu;
  if (name == "cuda") return StepDevice::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("the step device must be cpu or cuda, not '", name, "'"));
}

absl::Status ValidateCudaHybridOptions(const CudaHybridOptions& options) {
  if (options.micro_batches != 1 && options.micro_batches != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro-batches must be 1 or 2, not ", options.micro_batches));
  }
  if (options.micro_batches == 2 && options.max_requests < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("two micro-batches need at least 2 window slots (one each), not ",
                     options.max_requests, ": raise the slots or use one micro-batch"));
  }
  if (!(options.device_read_share >= 0 && options.device_read_share <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the device read share must be in [0, 1], not ", options.device_read_share));
  }
  return ValidateStallGuardOptions(options.stall_guard);
}

absl::StatusOr<std::unique_ptr<StepExecutor>> NewStepExecutor(const model::Model* model,
                                                              const kernels::cpu::CpuPool* pool,
                                                              KvArena* arena,
                                                              StepExecutorOptions options) {
  if (options.device == StepDevice::kCpu) return NewCpuStepExecutor(model, pool);
  FLUXION_RETURN_IF_ERROR(ValidateCudaHybridOptions(options.cuda));
#ifdef FLUXION_HAVE_CUDA
  PinOrReadOnHost(arena, &options.cuda);
  return NewCudaHybrid(model, pool, options.cuda);
#else
  (void)arena;
  return absl::FailedPreconditionError("this binary was built without CUDA");
#endif
}

double CompactGibPerRequest(const model::AttentionShape& attention, int64_t max_context_tokens) {
  kernels::CompactKeysLayout layout;
  layout.num_layers = attention.num_layers;
  layout.num_kv_heads = attention.num_kv_heads;
  layout.head_dim = attention.head_dim;
  layout.max_tokens = max_context_tokens;
  return static_cast<double>(layout.SlotBytes()) / static_cast<double>(int64_t{1} << 30);
}

int64_t CompactSlotsFor(const model::AttentionShape& attention, int64_t max_context_tokens,
                        double gib, int64_t max_requests) {
  const double per_slot = CompactGibPerRequest(attention, max_context_tokens);
  if (per_slot <= 0 || gib <= 0) return 0;
  return std::min<int64_t>(max_requests, static_cast<int64_t>(gib / per_slot));
}

}  // namespace fluxion::decode
