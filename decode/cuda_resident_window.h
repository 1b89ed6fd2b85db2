// The CUDA ResidentWindow (resident_window.h): the rings in device memory
// (kernels/cuda/window_ring.h), the step's slots and positions uploaded once per step from pinned
// staging, appends and attention on the dense ops' stream so they order after the step's q/k/v,
// the zero-copy reads of host pages on a lowest-priority stream of the window's own joined to it
// by events, and host partial states merged on the device (kernels/cuda MergeStates). Built only
// with CUDA.
#ifndef FLUXION_DECODE_CUDA_RESIDENT_WINDOW_H_
#define FLUXION_DECODE_CUDA_RESIDENT_WINDOW_H_

#include <cuda_runtime.h>

#include <memory>

#include "absl/status/statusor.h"
#include "decode/kv_arena.h"
#include "decode/ping_pong_step_executor.h"
#include "decode/resident_window.h"
#include "decode/stall_guard.h"
#include "decode/step_executor.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/model.h"

namespace fluxion::decode {

// Everything is allocated here (rings for shape.max_requests slots, per-step arrays for
// shape.max_rows rows). `stream` (the DenseOps's) must outlive the window. InvalidArgument for a
// bad shape or a head_dim other than 64 / 128 or more than 256 resident rows per head;
// ResourceExhausted when device or pinned memory runs out.
//
// Admission streams a request's page bounds to the device through two pinned chunks of
// `bounds_chunk_bytes` (at least one head's bounds each); tests pass a small size to exercise
// the chunking.
inline constexpr int64_t kDefaultBoundsChunkBytes = int64_t{32} << 20;
absl::StatusOr<std::unique_ptr<ResidentWindow>> NewCudaResidentWindow(
    const WindowShape& shape, cudaStream_t stream,
    int64_t bounds_chunk_bytes = kDefaultBoundsChunkBytes);

// Pins `arena`'s memory for the GPU (cudaHostRegister, mapped) until the arena dies, so the
// window can read host pages zero-copy (ResidentWindow::MappedView) and copies from it run at
// full PCIe speed. ResourceExhausted (with the likely cause) when the memory cannot be locked.
absl::Status PinArenaForCuda(KvArena* arena);

// The hybrid step executor on CUDA device 0 for `model` (decode/hybrid_step_executor.h): its
// weights uploaded to CudaDenseOps in bf16, a CUDA resident window of `max_requests` slots (sinks
// and window of the default policy config), the host part on `pool`. With two micro-batches, the
// ping-pong executor (decode/ping_pong_step_executor.h) over two such pipelines on device 0, each
// with its own CudaDenseOps (stream, scratch, graphs) and half the slots (A ceil, B floor of
// max_requests / 2), the weights uploaded once. What `fluxion decode --device cuda` serves with.
// FailedPrecondition without a device; InvalidArgument for micro_batches other than 1 or 2 or
// two micro-batches of fewer than 2 slots; the factories' errors.
struct CudaHybridOptions {
  int64_t max_requests = 128;      // window slots (both micro-batches' together)
  int64_t max_context_tokens = 0;  // page bounds per slot for block scores (0: the CPU scores)
  // Requests whose K the window keeps as compact rows for device selection (WindowShape::
  // compact_slots; CompactSlotsFor sizes it from an HBM budget); 0: the CPU selects.
  int64_t compact_slots = 0;
  int64_t page_tokens = 16;        // of the host KV pages
  double device_read_share = 0;    // HybridStepExecutor::set_device_read_share
  int micro_batches = 1;           // 1 or 2 (ping-pong; EXECUTOR.md section 8 says when it pays)
  StallGuardOptions stall_guard;   // dynamic degradation (decode/stall_guard.h); off by default
  // HybridStepExecutor::set_off_step_admission (one pipeline only; off by default).
  bool off_step_admission = false;
};
// One ping-pong pipeline on CUDA device `device`: a CudaDenseOps and a CUDA resident window of
// `shape` on its stream. The factories' errors.
absl::StatusOr<PingPongStepExecutor::Pipeline> NewCudaPipeline(const WindowShape& shape,
                                                               int device);
// The ping-pong executor's options for CUDA device `device`: each driver thread makes it current.
PingPongStepExecutor::Options CudaPingPongOptions(int device);

// How many requests of up to `max_context_tokens` fit their compact rows in `gib` GiB of HBM
// (kernels/compact_keys.h: 132 bytes per token, layer and KV head at head_dim 128), at most
// `max_requests`.
int64_t CompactSlotsFor(const model::AttentionShape& attention, int64_t max_context_tokens,
                        double gib, int64_t max_requests);

absl::StatusOr<std::unique_ptr<StepExecutor>> NewCudaHybridStepExecutor(
    const model::Model* model, const kernels::cpu::CpuPool* pool,
    const CudaHybridOptions& options);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_CUDA_RESIDENT_WINDOW_H_
