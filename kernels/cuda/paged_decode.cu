#include "kernels/cuda/paged_decode.h"

#include <cuda_bf16.h>

namespace fluxion::kernels::cuda {
namespace {

__device__ __forceinline__ float LoadBf16(const bf16* p) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
}

// One block per item, head_dim threads (thread t owns output dimension t of every head). Rows are
// gathered across spans into tiles of kTile: thread 0 walks the span list, warps score the tile's
// rows for all heads at once (lanes split head_dim), threads < group fold each head's running
// max and sum (online softmax), and every thread adds the tile's weighted V rows to its dimension.
template <int kHeadDim>
__global__ void PagedDecodeKernel(const uint8_t* arena, size_t page_bytes, int page_tokens,
                                  const PageSpan* spans, const PagedItem* items, int group,
                                  float scale) {
  constexpr int kTile = 64;
  constexpr int kG = static_cast<int>(kMaxPagedGroup);
  constexpr int kWarps = kHeadDim / 32;
  __shared__ float q[kG][kHeadDim];
  __shared__ float w[kG][kTile];  // scores, then softmax weights
  __shared__ const bf16* rows[kTile];
  __shared__ float run_max[kG], run_sum[kG], correction[kG];
  __shared__ int tile_rows, cursor_span, cursor_row;

  const PagedItem item = items[blockIdx.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int h = 0; h < group; ++h) q[h][tid] = item.q[h * kHeadDim + tid];
  if (tid < group) {
    run_max[tid] = -INFINITY;
    run_sum[tid] = 0.0f;
  }
  if (tid == 0) {
    cursor_span = item.span_begin;
    cursor_row = 0;
  }
  float acc[kG];
#pragma unroll
  for (int h = 0; h < kG; ++h) acc[h] = 0.0f;
  const int64_t value_offset = static_cast<int64_t>(page_tokens) * kHeadDim;

  while (true) {
    __syncthreads();  // the previous tile is fully consumed
    if (tid == 0) {
      int n = 0, s = cursor_span, r = cursor_row;
      while (n < kTile && s < item.span_end) {
        const PageSpan span = spans[s];
        if (r >= span.rows) {
          ++s;
          r = 0;
          continue;
        }
        const bf16* keys =
            reinterpret_cast<const bf16*>(arena + static_cast<size_t>(span.page) * page_bytes);
        rows[n++] = keys + static_cast<int64_t>(span.first_row + r) * kHeadDim;
        ++r;
      }
      tile_rows = n;
      cursor_span = s;
      cursor_row = r;
    }
    __syncthreads();
    const int n = tile_rows;
    if (n == 0) break;

    for (int r = warp; r < n; r += kWarps) {
      float dot[kG];
#pragma unroll
      for (int h = 0; h < kG; ++h) dot[h] = 0.0f;
      for (int d = lane; d < kHeadDim; d += 32) {
        const float k = LoadBf16(rows[r] + d);
#pragma unroll
        for (int h = 0; h < kG; ++h) {
          if (h < group) dot[h] += q[h][d] * k;
        }
      }
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        if (h >= group) break;
        float v = dot[h];
        for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
        if (lane == 0) w[h][r] = v * scale;
      }
    }
    __syncthreads();
    if (tid < group) {
      float m = run_max[tid];
      for (int r = 0; r < n; ++r) m = fmaxf(m, w[tid][r]);
      correction[tid] = __expf(run_max[tid] - m);  // 0 on the first tile (run_max = -inf)
      run_max[tid] = m;
    }
    __syncthreads();
    for (int i = tid; i < group * n; i += blockDim.x) {
      const int h = i / n, r = i % n;
      w[h][r] = __expf(w[h][r] - run_max[h]);
    }
    __syncthreads();
    if (tid < group) {
      float sum = 0.0f;
      for (int r = 0; r < n; ++r) sum += w[tid][r];
      run_sum[tid] = run_sum[tid] * correction[tid] + sum;
    }
#pragma unroll
    for (int h = 0; h < kG; ++h) {
      if (h < group) acc[h] *= correction[h];
    }
    for (int r = 0; r < n; ++r) {
      const float v = LoadBf16(rows[r] + value_offset + tid);
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        if (h < group) acc[h] += w[h][r] * v;
      }
    }
  }
  // The loop ends right after a barrier, so run_sum/run_max are final and visible.
  for (int h = 0; h < group; ++h) {
    const float l = run_sum[h];
    item.out[h * kHeadDim + tid] = l > 0.0f ? acc[h] / l : 0.0f;
    if (tid == 0) item.lse[h] = l > 0.0f ? run_max[h] + logf(l) : -INFINITY;
  }
}

}  // namespace

cudaError_t PagedDecodeAttention(const uint8_t* arena, size_t page_bytes, int64_t page_tokens,
                                 int64_t head_dim, const PageSpan* spans, const PagedItem* items,
                                 int64_t num_items, int64_t group, float scale,
                                 cudaStream_t stream) {
  if (num_items == 0) return cudaSuccess;
  if (group < 1 || group > kMaxPagedGroup || num_items > 2147483647 || page_tokens <= 0 ||
      page_tokens > 65536 ||
      page_bytes < static_cast<size_t>(2 * page_tokens * head_dim * sizeof(bf16))) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks = static_cast<unsigned>(num_items);
  const int pt = static_cast<int>(page_tokens), g = static_cast<int>(group);
  switch (head_dim) {
    case 64:
      PagedDecodeKernel<64><<<blocks, 64, 0, stream>>>(arena, page_bytes, pt, spans, items, g,
                                                        scale);
      break;
    case 128:
      PagedDecodeKernel<128><<<blocks, 128, 0, stream>>>(arena, page_bytes, pt, spans, items, g,
                                                          scale);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

std::vector<int32_t> SplitByRows(const PageSpan* spans, int32_t begin, int32_t end,
                                 int64_t max_rows) {
  std::vector<int32_t> bounds = {begin};
  int64_t rows = 0;
  for (int32_t s = begin; s < end; ++s) {
    if (rows > 0 && rows + spans[s].rows > max_rows) {
      bounds.push_back(s);
      rows = 0;
    }
    rows += spans[s].rows;
  }
  if (end > begin) bounds.push_back(end);
  return bounds;
}

}  // namespace fluxion::kernels::cuda
