// Internal to kernels/cuda: the launch of PagedKernel::kV5 (paged_decode_mma.cu), called by
// PagedDecodeAttention (paged_decode.h), which checks the arguments shared by every kernel.
#ifndef FLUXION_KERNELS_CUDA_PAGED_DECODE_MMA_H_
#define FLUXION_KERNELS_CUDA_PAGED_DECODE_MMA_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/paged_decode.h"

namespace fluxion::kernels::cuda {

struct PagedLaunch {
  unsigned blocks;  // one per item
  cudaStream_t stream;
  const uint8_t* arena;
  size_t page_bytes;
  int64_t page_tokens;
  int64_t head_dim;
  const PageSpan* spans;
  const PagedItem* items;
  int group;
  float scale;
};

// Three-stage rings (two units in flight per warp, 2 blocks per SM). head_dim 64 / 128,
// page_tokens 8 / 16 / 32 / 64, group <= 8; cudaErrorInvalidValue otherwise.
cudaError_t LaunchPagedDecodeV5(const PagedLaunch& launch);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_PAGED_DECODE_MMA_H_
