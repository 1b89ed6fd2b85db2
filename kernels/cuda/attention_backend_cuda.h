// The CUDA backend of the attention seam (kernels/attention_backend.h): the paged decode kernel
// (paged_decode.h) over every (request, KV head) pair of a batch, split-KV (flash-decoding): each
// pair's spans are cut into chunks of at most `spans_per_chunk` spans, chunks run as blocks of one
// launch, and MergeChunks (decode_ops.h) folds each pair's chunk states into out / lse.
//
// Memory: every pointer of the problem is device memory, except kv.arena, which may also be
// pinned host memory mapped for the device (zero-copy reads over PCIe). The span lists and indptr
// stay on the device, so the cut into chunks is planned there too (one small kernel): the host
// never reads them, Run never synchronises, and the chunk count is bounded from the shapes and
// num_spans alone (WorkspaceBytes): num_spans / spans_per_chunk + num_pairs chunks.
//
// Run enqueues three launches (plan, attention, merge) on the backend's stream and returns; the
// outputs are ready when the stream reaches that point. Errors: a launch error is Internal.
//
// Thread-compatible, as AttentionBackend: Run on one backend from one thread at a time (all use
// the same stream); Supports and WorkspaceBytes are thread-safe.
#ifndef FLUXION_KERNELS_CUDA_ATTENTION_BACKEND_CUDA_H_
#define FLUXION_KERNELS_CUDA_ATTENTION_BACKEND_CUDA_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/attention_backend.h"
#include "kernels/cuda/paged_decode.h"

namespace fluxion::kernels::cuda {

struct CudaAttentionBackendOptions {
  cudaStream_t stream = nullptr;  // the caller's; must outlive the backend. Null: legacy default
  // kV5: 4.1-4.3 TB/s over HBM-resident pages on the H200 at 8B shapes (97-101% of the bench's
  // limit; bench/results/gpu-kernels-paged-v5-h200-20261202.json). For arenas in pinned host
  // memory kV3 reads best (90-95% of the H2D probe, v5 ~47%;
  // bench/results/gpu-kernels-paged-v3-v4-h200-20261202.json).
  PagedKernel kernel = PagedKernel::kV5;
  int num_sms = 0;  // the chunk plan aims at one wave on this many SMs; 0: the current device's
};

// The cut CudaAttentionBackend makes: spans per chunk for p when `block_slots` blocks run at once
// (SMs x PagedBlocksPerSm), from the shapes and num_spans only. One wave of blocks: each pair cut
// into floor(block_slots / pairs) chunks (at least one) of at least kMinPagedChunkRows rows of whole
// pages; at least one span.
int64_t CudaAttentionSpansPerChunk(const PagedDecodeProblem& p, int64_t block_slots);

// Workspace bytes for p with chunks of `spans_per_chunk` spans (at most
// num_spans / spans_per_chunk + num_pairs chunks): chunk offsets, items, chunk states.
size_t CudaAttentionWorkspaceBytes(const PagedDecodeProblem& p, int64_t spans_per_chunk);

class CudaAttentionBackend final : public AttentionBackend {
 public:
  // FailedPrecondition without a usable CUDA device.
  static absl::StatusOr<std::unique_ptr<CudaAttentionBackend>> Create(
      const CudaAttentionBackendOptions& options);

  absl::string_view name() const override;
  // Beyond ValidatePagedDecodeProblem, Unimplemented for: head_dim other than 64/128, a group
  // above kMaxPagedGroup, page_tokens other than 8/16/32 (64 too for v5), page_bytes or the
  // arena not 16-byte aligned, num_spans or num_pairs beyond int32.
  absl::Status Supports(const PagedDecodeProblem& p) const override;
  size_t WorkspaceBytes(const PagedDecodeProblem& p) const override;
  // REQUIRES: as AttentionBackend::Run; `workspace` in device memory. InvalidArgument when it
  // is smaller than WorkspaceBytes(p) or not 8-byte aligned (cudaMalloc's 256 always is).
  absl::Status Run(const PagedDecodeProblem& p, absl::Span<std::byte> workspace) override;

 private:
  explicit CudaAttentionBackend(const CudaAttentionBackendOptions& options) : options_(options) {}
  int64_t BlockSlots() const;  // num_sms x PagedBlocksPerSm(kernel)
  CudaAttentionBackendOptions options_;
};

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_ATTENTION_BACKEND_CUDA_H_
