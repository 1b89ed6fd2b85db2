// The CUDA ResidentWindow (resident_window.h): the rings in device memory
// (kernels/cuda/window_ring.h), the step's slots and positions uploaded once per step from pinned
// staging, appends and attention on the dense ops' stream so they order after the step's q/k/v,
// the zero-copy reads of host pages on a lowest-priority stream of the window's own joined to it
// by events, and host partial states merged on the device (kernels/cuda MergeStates). Built only
// with CUDA.
#ifndef FLUXION_DECODE_DEVICE_CUDA_RESIDENT_WINDOW_H_
#define FLUXION_DECODE_DEVICE_CUDA_RESIDENT_WINDOW_H_

#include <cuda_runtime.h>

#include <memory>

#include "absl/status/statusor.h"
#include "decode/kv/kv_arena.h"
#include "decode/step/ping_pong_step_executor.h"
#include "decode/step/resident_window.h"
#include "decode/step/step_executor.h"
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

// The pieces the step executor factory (decode/step/step_executor_factory.h) builds the hybrid step
// from; it alone decides which executor serves.
//
// One ping-pong pipeline on CUDA device `device`: a CudaDenseOps and a CUDA resident window of
// `shape` on its stream. The factories' errors.
absl::StatusOr<PingPongStepExecutor::Pipeline> NewCudaPipeline(const WindowShape& shape,
                                                               int device);
// The ping-pong executor's options for CUDA device `device`: each driver thread makes it current.
PingPongStepExecutor::Options CudaPingPongOptions(int device);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_DEVICE_CUDA_RESIDENT_WINDOW_H_
