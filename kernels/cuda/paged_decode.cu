#include "kernels/cuda/paged_decode.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/paged_decode_mma.h"

namespace fluxion::kernels::cuda {
namespace {

__device__ __forceinline__ void UnpackBf16x8(const uint4& raw, float out[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// One block of 128 threads per item (a chunk of one (request, KV head)), all `group` query heads
// at once so each K/V row is read once. Spans are taken kSlots / kPageTokens at a time; a tile
// has kSlots row slots (slots past a span's rows score -inf and weigh 0).
//   keys:    kLanesPerRow lanes per row, each a 16-byte load of 8 dims (a 128-dim row is one
//            256-byte read by half a warp); every thread issues all its loads of the tile before
//            using any (kKLoads 16-byte loads in flight per thread), then a shuffle reduction
//            per head;
//   softmax: one warp per head folds the tile into the running max and sum (online softmax);
//   values:  thread (row group rg, dim group dg) loads rows rg, rg + kRowGroups, ... of dims
//            [8 dg, 8 dg + 8), again all loads first, and accumulates them for every head; the
//            row groups are summed once at the end.
// Issuing the loads first is what moves the kernel from latency- to bandwidth-bound: with one
// load in flight per thread, an earlier version of this kernel read HBM at ~0.9 TB/s.
// One function on purpose, past the house's ~120 lines: its per-thread arrays (keys, values, the
// accumulators) live in registers across the tile's phases, and the same phases as inline helpers
// made ptxas spill (sm_90, head_dim 64: 4 -> 68 bytes of spill loads per thread).
template <int kHeadDim, int kPageTokens>
__global__ void __launch_bounds__(128)
    PagedDecodeKernelV3(const uint8_t* arena, size_t page_bytes, const PageSpan* spans,
                      const PagedItem* items, int group, float scale) {
  constexpr int kThreads = 128, kWarps = 4, kVec = 8;
  constexpr int kG = static_cast<int>(kMaxPagedGroup);
  constexpr int kSlots = 128;
  constexpr int kSpansPerTile = kSlots / kPageTokens;
  constexpr int kLanesPerRow = kHeadDim / kVec;  // 16 (d128) or 8 (d64)
  constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  constexpr int kRowGroups = kThreads / kLanesPerRow;
  constexpr int kKLoads = kSlots / (kWarps * kRowsPerWarp);
  constexpr int kVLoads = kSlots / kRowGroups;
  __shared__ float q[kG][kHeadDim];
  __shared__ float w[kG][kSlots];  // scores, then softmax weights
  __shared__ float run_max[kG], run_sum[kG], correction[kG];
  __shared__ const bf16* span_keys[kSpansPerTile];  // K row `first_row` of each span
  __shared__ int span_rows[kSpansPerTile];
  __shared__ float partial[kRowGroups][kHeadDim];

  const PagedItem item = items[blockIdx.x];
  if (item.out == nullptr) return;  // a padding item of a device-side plan
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
  constexpr int64_t kValueOffset = static_cast<int64_t>(kPageTokens) * kHeadDim;
  const uint4 zero = make_uint4(0, 0, 0, 0);

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

    uint4 keys[kKLoads];
#pragma unroll
    for (int i = 0; i < kKLoads; ++i) {
      const int slot = warp * kRowsPerWarp + sub + i * kWarps * kRowsPerWarp;
      const int s = slot / kPageTokens, r = slot % kPageTokens;
      keys[i] = r < span_rows[s] ? *reinterpret_cast<const uint4*>(
                                       span_keys[s] + static_cast<int64_t>(r) * kHeadDim +
                                       dg * kVec)
                                 : zero;
    }
#pragma unroll
    for (int i = 0; i < kKLoads; ++i) {
      const int slot = warp * kRowsPerWarp + sub + i * kWarps * kRowsPerWarp;
      const int s = slot / kPageTokens, r = slot % kPageTokens;
      const bool valid = r < span_rows[s];
      float k[kVec];
      UnpackBf16x8(keys[i], k);
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        if (h < group) {
          float v = 0.0f;
#pragma unroll
          for (int j = 0; j < kVec; ++j) v += q[h][dg * kVec + j] * k[j];
#pragma unroll
          for (int offset = kLanesPerRow / 2; offset > 0; offset >>= 1) {
            v += __shfl_xor_sync(0xffffffffu, v, offset);
          }
          if (dg == 0) w[h][slot] = valid ? v * scale : -INFINITY;
        }
      }
    }
    __syncthreads();

    // The value loads do not depend on the softmax: in flight while it runs.
    uint4 values[kVLoads];
#pragma unroll
    for (int i = 0; i < kVLoads; ++i) {
      const int slot = rg + i * kRowGroups;
      const int s = slot / kPageTokens, r = slot % kPageTokens;
      values[i] = r < span_rows[s] ? *reinterpret_cast<const uint4*>(
                                         span_keys[s] + kValueOffset +
                                         static_cast<int64_t>(r) * kHeadDim + dg * kVec)
                                   : zero;
    }
    for (int h = warp; h < group; h += kWarps) {
      float m = -INFINITY;
      for (int i = lane; i < kSlots; i += 32) m = fmaxf(m, w[h][i]);
      for (int offset = 16; offset > 0; offset >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
      }
      const float old_max = run_max[h];
      const float new_max = fmaxf(old_max, m);
      float sum = 0.0f;
      for (int i = lane; i < kSlots; i += 32) {
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
#pragma unroll
    for (int i = 0; i < kVLoads; ++i) {
      const int slot = rg + i * kRowGroups;
      float v[kVec];
      UnpackBf16x8(values[i], v);  // an invalid slot loaded zeros and weighs 0
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

template <int kHeadDim>
cudaError_t LaunchV3ForPageTokens(int64_t page_tokens, unsigned blocks, cudaStream_t stream,
                                const uint8_t* arena, size_t page_bytes, const PageSpan* spans,
                                const PagedItem* items, int group, float scale) {
  switch (page_tokens) {
    case 8:
      PagedDecodeKernelV3<kHeadDim, 8><<<blocks, 128, 0, stream>>>(arena, page_bytes, spans, items,
                                                                 group, scale);
      break;
    case 16:
      PagedDecodeKernelV3<kHeadDim, 16><<<blocks, 128, 0, stream>>>(arena, page_bytes, spans,
                                                                  items, group, scale);
      break;
    case 32:
      PagedDecodeKernelV3<kHeadDim, 32><<<blocks, 128, 0, stream>>>(arena, page_bytes, spans,
                                                                  items, group, scale);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t PagedDecodeAttention(const uint8_t* arena, size_t page_bytes, int64_t page_tokens,
                                 int64_t head_dim, const PageSpan* spans, const PagedItem* items,
                                 int64_t num_items, int64_t group, float scale,
                                 cudaStream_t stream, PagedKernel kernel) {
  if (num_items == 0) return cudaSuccess;
  // 16-byte aligned pages and arena: every row is read with 16-byte loads.
  const bool page_tokens_ok =
      kernel == PagedKernel::kV3
          ? (page_tokens == 8 || page_tokens == 16 || page_tokens == 32)
          : (page_tokens == 8 || page_tokens == 16 || page_tokens == 32 || page_tokens == 64);
  if (group < 1 || group > kMaxPagedGroup || num_items > 2147483647 || !page_tokens_ok ||
      page_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(arena) % 16 != 0 ||
      page_bytes < static_cast<size_t>(2 * page_tokens * head_dim * sizeof(bf16))) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks = static_cast<unsigned>(num_items);
  const int g = static_cast<int>(group);
  if (kernel == PagedKernel::kV5) {
    return LaunchPagedDecodeV5(
        {blocks, stream, arena, page_bytes, page_tokens, head_dim, spans, items, g, scale});
  }
  switch (head_dim) {
    case 64:
      return LaunchV3ForPageTokens<64>(page_tokens, blocks, stream, arena, page_bytes, spans,
                                       items, g, scale);
    case 128:
      return LaunchV3ForPageTokens<128>(page_tokens, blocks, stream, arena, page_bytes, spans,
                                        items, g, scale);
    default:
      return cudaErrorInvalidValue;
  }
}

const char* PagedKernelName(PagedKernel kernel) {
  switch (kernel) {
    case PagedKernel::kV3:
      return "v3";
    case PagedKernel::kV5:
      return "v5";
  }
  return "unknown";
}

bool PagedKernelFromName(const std::string& name, PagedKernel* kernel) {
  for (PagedKernel k : {PagedKernel::kV3, PagedKernel::kV5}) {
    if (name == PagedKernelName(k)) {
      *kernel = k;
      return true;
    }
  }
  return false;
}

int PagedBlocksPerSm(PagedKernel kernel) { return kernel == PagedKernel::kV3 ? 4 : 2; }

int64_t ChoosePagedChunkRows(PagedKernel kernel, int64_t total_rows, int64_t items,
                             int num_sms) {
  if (kernel == PagedKernel::kV3) return ChooseChunkRows(total_rows, num_sms);
  // One wave of v5 blocks: each item gets floor(slots / items) chunks (at least one), so the grid
  // fills the GPU once with equal chunks and leaves no tail wave.
  const int64_t slots = PagedBlocksPerSm(kernel) * static_cast<int64_t>(std::max(1, num_sms));
  const int64_t n = std::max<int64_t>(1, items);
  const int64_t per_item = std::max<int64_t>(1, slots / n);
  const int64_t rows_per_item = (std::max<int64_t>(0, total_rows) + n - 1) / n;
  const int64_t rows = (rows_per_item + per_item - 1) / per_item;
  return std::max<int64_t>(kMinPagedChunkRows, (rows + 15) / 16 * 16);
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
