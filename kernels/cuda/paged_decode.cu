#include "kernels/cuda/paged_decode.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

namespace fluxion::kernels::cuda {
namespace {

// Eight bf16 from one 16-byte load.
__device__ __forceinline__ void LoadBf16x8(const bf16* p, float out[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// One block of 128 threads per item (a chunk of one (request, KV head)), all `group` query heads
// at once so each K/V row is read once. The spans are taken kSpansPerTile at a time; a tile has
// kSpansPerTile * page_tokens slots (slots past a span's rows score -inf and weigh 0).
//   scoring: kLanesPerRow lanes per row, each a 16-byte load of 8 dims (a 128-dim row is one
//            256-byte read by half a warp), a shuffle reduction per head;
//   softmax: one warp per head folds the tile into the running max and sum (online softmax);
//   values:  thread (row group rg, dim group dg) accumulates rows rg, rg + kRowGroups, ... of
//            dims [8 dg, 8 dg + 8) for every head; row groups are summed once at the end.
template <int kHeadDim>
__global__ void __launch_bounds__(128)
    PagedDecodeKernel(const uint8_t* arena, size_t page_bytes, int page_tokens,
                      const PageSpan* spans, const PagedItem* items, int group, float scale) {
  constexpr int kThreads = 128, kWarps = 4, kVec = 8;
  constexpr int kG = static_cast<int>(kMaxPagedGroup);
  constexpr int kSpansPerTile = 8;
  constexpr int kMaxSlots = kSpansPerTile * 32;  // page_tokens <= 32
  constexpr int kLanesPerRow = kHeadDim / kVec;  // 16 (d128) or 8 (d64)
  constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  constexpr int kRowGroups = kThreads / kLanesPerRow;
  __shared__ float q[kG][kHeadDim];
  __shared__ float w[kG][kMaxSlots];  // scores, then softmax weights
  __shared__ float run_max[kG], run_sum[kG], correction[kG];
  __shared__ const bf16* span_keys[kSpansPerTile];  // K row `first_row` of each span
  __shared__ int span_rows[kSpansPerTile];
  __shared__ float partial[kRowGroups][kHeadDim];

  const PagedItem item = items[blockIdx.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int dg = tid % kLanesPerRow, rg = tid / kLanesPerRow;
  const int sub = lane / kLanesPerRow;
  for (int i = tid; i < group * kHeadDim; i += kThreads) q[i / kHeadDim][i % kHeadDim] = item.q[i];
  if (tid < group) {
    run_max[tid] = -INFINITY;
    run_sum[tid] = 0.0f;
  }
  float acc[kG][kVec];
#pragma unroll
  for (int h = 0; h < kG; ++h) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[h][j] = 0.0f;
  }
  const int slots = kSpansPerTile * page_tokens;  // a multiple of 16: uniform warp loops below
  const int64_t value_offset = static_cast<int64_t>(page_tokens) * kHeadDim;

  for (int s0 = item.span_begin; s0 < item.span_end; s0 += kSpansPerTile) {
    __syncthreads();  // the previous tile is consumed
    if (tid < kSpansPerTile) {
      const int s = s0 + tid;
      if (s < item.span_end) {
        const PageSpan span = spans[s];
        span_keys[tid] =
            reinterpret_cast<const bf16*>(arena + static_cast<size_t>(span.page) * page_bytes) +
            static_cast<int64_t>(span.first_row) * kHeadDim;
        span_rows[tid] = span.rows;
      } else {
        span_rows[tid] = 0;
      }
    }
    __syncthreads();

    for (int slot = warp * kRowsPerWarp + sub; slot < slots; slot += kWarps * kRowsPerWarp) {
      const int s = slot / page_tokens, r = slot % page_tokens;
      const bool valid = r < span_rows[s];
      float dot[kG];
#pragma unroll
      for (int h = 0; h < kG; ++h) dot[h] = 0.0f;
      if (valid) {
        float k[kVec];
        LoadBf16x8(span_keys[s] + static_cast<int64_t>(r) * kHeadDim + dg * kVec, k);
#pragma unroll
        for (int h = 0; h < kG; ++h) {
          if (h < group) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) dot[h] += q[h][dg * kVec + j] * k[j];
          }
        }
      }
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        if (h < group) {
          float v = dot[h];
#pragma unroll
          for (int offset = kLanesPerRow / 2; offset > 0; offset >>= 1) {
            v += __shfl_xor_sync(0xffffffffu, v, offset);
          }
          if (dg == 0) w[h][slot] = valid ? v * scale : -INFINITY;
        }
      }
    }
    __syncthreads();

    for (int h = warp; h < group; h += kWarps) {
      float m = -INFINITY;
      for (int i = lane; i < slots; i += 32) m = fmaxf(m, w[h][i]);
      for (int offset = 16; offset > 0; offset >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
      }
      const float old_max = run_max[h];
      const float new_max = fmaxf(old_max, m);
      float sum = 0.0f;
      for (int i = lane; i < slots; i += 32) {
        const float e = new_max == -INFINITY ? 0.0f : __expf(w[h][i] - new_max);
        w[h][i] = e;
        sum += e;
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      }
      if (lane == 0) {
        const float c = new_max == -INFINITY ? 1.0f : __expf(old_max - new_max);
        correction[h] = c;
        run_sum[h] = run_sum[h] * c + sum;
        run_max[h] = new_max;
      }
    }
    __syncthreads();

#pragma unroll
    for (int h = 0; h < kG; ++h) {
      if (h < group) {
        const float c = correction[h];
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[h][j] *= c;
      }
    }
    for (int slot = rg; slot < slots; slot += kRowGroups) {
      const int s = slot / page_tokens, r = slot % page_tokens;
      if (r >= span_rows[s]) continue;
      float v[kVec];
      LoadBf16x8(span_keys[s] + value_offset + static_cast<int64_t>(r) * kHeadDim + dg * kVec, v);
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        if (h < group) {
          const float wt = w[h][slot];
#pragma unroll
          for (int j = 0; j < kVec; ++j) acc[h][j] += wt * v[j];
        }
      }
    }
  }

  // Sum the row groups' partial outputs, head by head.
#pragma unroll
  for (int h = 0; h < kG; ++h) {
    if (h >= group) break;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kVec; ++j) partial[rg][dg * kVec + j] = acc[h][j];
    __syncthreads();
    const float l = run_sum[h];
    for (int d = tid; d < kHeadDim; d += kThreads) {
      float total = 0.0f;
#pragma unroll
      for (int g = 0; g < kRowGroups; ++g) total += partial[g][d];
      item.out[h * kHeadDim + d] = l > 0.0f ? total / l : 0.0f;
    }
    if (tid == 0) item.lse[h] = l > 0.0f ? run_max[h] + logf(l) : -INFINITY;
  }
}

}  // namespace

cudaError_t PagedDecodeAttention(const uint8_t* arena, size_t page_bytes, int64_t page_tokens,
                                 int64_t head_dim, const PageSpan* spans, const PagedItem* items,
                                 int64_t num_items, int64_t group, float scale,
                                 cudaStream_t stream) {
  if (num_items == 0) return cudaSuccess;
  // Even page_tokens up to 32 (tiles of 8 spans fit the shared score buffer and warp loops stay
  // uniform); 16-byte aligned pages and arena (every row is read with 16-byte loads).
  if (group < 1 || group > kMaxPagedGroup || num_items > 2147483647 || page_tokens < 2 ||
      page_tokens > 32 || page_tokens % 2 != 0 || page_bytes % 16 != 0 ||
      reinterpret_cast<uintptr_t>(arena) % 16 != 0 ||
      page_bytes < static_cast<size_t>(2 * page_tokens * head_dim * sizeof(bf16))) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks = static_cast<unsigned>(num_items);
  const int pt = static_cast<int>(page_tokens), g = static_cast<int>(group);
  switch (head_dim) {
    case 64:
      PagedDecodeKernel<64><<<blocks, 128, 0, stream>>>(arena, page_bytes, pt, spans, items, g,
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

int64_t ChooseChunkRows(int64_t total_rows, int num_sms) {
  const int64_t target_blocks = 4 * static_cast<int64_t>(std::max(1, num_sms));
  const int64_t rows = (total_rows + target_blocks - 1) / target_blocks;
  return std::clamp<int64_t>((rows + 127) / 128 * 128, 128, 8192);
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
