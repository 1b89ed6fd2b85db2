// The sparse state's raw sums for one layer on the GPU (model/sparse_state.h defines them; the
// prefill node captures them from the prompt's last query rows, issue 15): the full attention of
// each tail row over the layer's pages, maxed over the GQA group, folded into LFPS's vertical and
// slash tables, plus the per-row quantities the head features average. The host turns those into
// model::HeadSparseState (prefill/device_prefill.cc); model::CaptureSparseState is the reference.
//
// The tail rows are consecutive positions [tokens - rows, tokens) (the prefill's last rows). Keys
// are the pages' bf16 values, so results match the fp32 CPU capture to bf16 rounding.
//
// Thread-safe: launches on the caller's stream; scratch is the caller's.
#ifndef FLUXION_KERNELS_CUDA_SPARSE_CAPTURE_H_
#define FLUXION_KERNELS_CUDA_SPARSE_CAPTURE_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/prefill_attention.h"

namespace fluxion::kernels::cuda {

struct TailCaptureParams {
  int64_t tokens = 0;     // the prompt's length; the pages hold keys [0, tokens)
  int64_t rows = 0;       // tail rows, at positions [tokens - rows, tokens); 1..32
  int64_t num_heads = 0;  // query heads (a multiple of the pages' KV heads)
  float scale = 0;        // softmax(scale * q.k)
  double decay = 0.95;    // row i weighs decay^(tokens - 1 - position)
  int64_t sink_tokens = 4;
  int64_t local_tokens = 64;
  double coverage = 0.9;
};

inline constexpr int64_t kMaxTailRows = 32;

// Per tail row and query head: sink, local and entropy of its attention (nats).
struct TailRowHeadStats {
  float sink = 0, local = 0, entropy = 0;
};
// Per tail row and KV head, over the group's max: the middle's mass and how many of its largest
// keys cover `coverage` of it (0 when the row has no middle or it holds no mass), of `middle`.
struct TailRowMiddle {
  float share = 0;
  int64_t needed = 0;
  int64_t middle = 0;
};

// Device scratch CaptureLayerTail needs for these sizes.
size_t TailCaptureScratchBytes(int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                               int64_t tokens);

// One layer: tail_q [rows][num_heads][head_dim] fp32 (post-RoPE) over `pages`; writes vertical
// and slash [num_kv_heads][tokens], row_heads [rows][num_heads] and middles [rows][num_kv_heads]
// (all device memory). InvalidValue for sizes out of range.
cudaError_t CaptureLayerTail(const LayerPages& pages, const float* tail_q,
                             const TailCaptureParams& params, void* scratch, float* vertical,
                             float* slash, TailRowHeadStats* row_heads, TailRowMiddle* middles,
                             cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_SPARSE_CAPTURE_H_
