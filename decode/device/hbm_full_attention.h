// Full attention with the whole KV in HBM: the reference a user picks when the KV fits on the
// GPU, and the HBM-resident whole step the hybrid step is measured against (issue 14). A
// model::BatchAttention for a DecodeStepRunner on CUDA dense ops: per layer the step's K/V are
// appended to device pages (kernels/cuda/window_ring.h HbmPageAppend) and every (row, KV head)
// attends all its tokens through the CUDA attention backend (kernels/cuda/attention_backend_cuda.h)
// into io.out. Layers have arenas of the same layout, so one span list per step serves every layer:
// BeginStep uploads the rows' slots, positions and span offsets (rows x KV heads + 1) from pinned
// staging and the spans are written on the device (kernels/cuda/page_spans.h), so the host's
// per-step work does not grow with the contexts. Attend only launches (append, plan, attention,
// merge): no host work, synchronisation or allocation per layer.
//
// Thread-compatible; CUDA builds only.
#ifndef FLUXION_DECODE_DEVICE_HBM_FULL_ATTENTION_H_
#define FLUXION_DECODE_DEVICE_HBM_FULL_ATTENTION_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/cuda/attention_backend_cuda.h"
#include "model/decode_step.h"

namespace fluxion::decode {

struct HbmKvShape {
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  float scale = 0.0f;
  int64_t page_tokens = 16;
  int64_t max_requests = 1;  // slots
  int64_t max_tokens = 0;    // per slot

  int64_t max_pages() const { return (max_tokens + page_tokens - 1) / page_tokens; }
  size_t page_bytes() const { return 2 * page_tokens * head_dim * 2; }
  size_t layer_bytes() const { return max_requests * num_kv_heads * max_pages() * page_bytes(); }
};

class HbmFullAttention : public model::BatchAttention {
 public:
  // Allocates the KV (layers x layer_bytes of HBM) and the per-step arrays on the device.
  // ResourceExhausted when HBM is short; InvalidArgument for a bad shape.
  static absl::StatusOr<std::unique_ptr<HbmFullAttention>> Create(
      const HbmKvShape& shape, cudaStream_t stream, kernels::cuda::PagedKernel kernel);
  ~HbmFullAttention() override;

  // Random bf16 K/V for the first `tokens` tokens of `slot` in every layer (benchmarks).
  absl::Status FillRandom(int slot, int64_t tokens, uint64_t seed);
  // The first `tokens` tokens of `slot` in `layer` from host rows (rounded to bf16): k, v
  // [tokens][num_kv_heads][head_dim] fp32, e.g. a CPU prefill's cache. Waits for the copies.
  absl::Status LoadTokens(int slot, int layer, int64_t tokens, const float* k, const float* v);

  // The rows of the next step (row i: slot slots[i], its token at positions[i]). InvalidArgument
  // for a slot out of range, more rows than slots, or a position at or past max_tokens.
  absl::Status BeginStep(absl::Span<const int> slots, absl::Span<const int64_t> positions);
  // io.q/k/v/out in device memory (a CUDA DenseOps). Errors: Internal for a CUDA failure.
  absl::Status Attend(const model::LayerAttentionIo& io) override;

 private:
  HbmFullAttention(const HbmKvShape& shape, cudaStream_t stream) : shape_(shape), stream_(stream) {}
  absl::Status Check(cudaError_t e, const char* what);

  const HbmKvShape shape_;
  const cudaStream_t stream_;
  std::unique_ptr<kernels::cuda::CudaAttentionBackend> backend_;
  void* kv_ = nullptr;           // [layer][slot][kv_head][max_pages] pages
  void* lse_ = nullptr;          // [rows][num_heads]
  void* step_ = nullptr;         // device: slots, positions, indptr, spans
  void* staging_ = nullptr;      // pinned host copy of step_
  size_t step_bytes_ = 0;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  int64_t rows_ = 0, num_spans_ = 0;
  int32_t* slots_dev_ = nullptr;
  int64_t* positions_dev_ = nullptr;
  int64_t* indptr_dev_ = nullptr;
  kernels::PageSpan* spans_dev_ = nullptr;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_DEVICE_HBM_FULL_ATTENTION_H_
