#include "kernels/cuda/gemv.h"

#include <cstdint>
#include <limits>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kWarps = 8;     // output columns per block
constexpr int kUnroll = 4;    // 16-byte loads of w in flight per lane

// The two bf16 halves of a word as floats (exact: a bf16 is a float's top 16 bits).
__device__ __forceinline__ float Lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float Hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ float Dot2(uint32_t a, uint32_t b, float s) {
  return fmaf(Hi(a), Hi(b), fmaf(Lo(a), Lo(b), s));
}

__device__ __forceinline__ float Dot8(const uint4& a, const uint4& b) {
  return Dot2(a.w, b.w, Dot2(a.z, b.z, Dot2(a.y, b.y, Dot2(a.x, b.x, 0.0f))));
}

// Block: kWarps warps, warp j computes column blockIdx.x * kWarps + j for all M rows. Every load
// is guarded by the chunk count, so no index leaves w's row or x's rows.
template <int M>
__global__ void __launch_bounds__(kWarps * 32)
    GemvKernel(const uint4* __restrict__ x, const uint4* __restrict__ w, float* __restrict__ y,
               int n, int chunks, bool accumulate) {
  const int lane = threadIdx.x % 32;
  const int col = blockIdx.x * kWarps + threadIdx.x / 32;
  if (col >= n) return;
  const uint4* wr = w + static_cast<int64_t>(col) * chunks;
  float acc[M];
#pragma unroll
  for (int r = 0; r < M; ++r) acc[r] = 0.0f;
  for (int c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32;
      wv[u] = c < chunks ? __ldg(wr + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32;
      if (c < chunks) {
#pragma unroll
        for (int r = 0; r < M; ++r) {
          acc[r] += Dot8(wv[u], __ldg(x + static_cast<int64_t>(r) * chunks + c));
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < M; ++r) {
    float s = acc[r];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) {
      float* out = y + static_cast<int64_t>(r) * n + col;
      *out = accumulate ? *out + s : s;
    }
  }
}

template <int M>
void Launch(const uint4* x, const uint4* w, float* y, int n, int chunks, bool accumulate,
            cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((n + kWarps - 1) / kWarps);
  GemvKernel<M><<<blocks, kWarps * 32, 0, stream>>>(x, w, y, n, chunks, accumulate);
}

}  // namespace

cudaError_t GemvBf16(const bf16* x, const bf16* w, float* y, int64_t m, int64_t n, int64_t k,
                     bool accumulate, cudaStream_t stream) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(w) % 16 == 0;
  if (m < 1 || m > kMaxGemvRows || n < 1 || k < 8 || n > kMax || k > kMax || k % 8 != 0 ||
      !aligned) {
    return cudaErrorInvalidValue;
  }
  const auto* xv = reinterpret_cast<const uint4*>(x);
  const auto* wv = reinterpret_cast<const uint4*>(w);
  const int nn = static_cast<int>(n), chunks = static_cast<int>(k / 8);
  switch (m) {
    case 1: Launch<1>(xv, wv, y, nn, chunks, accumulate, stream); break;
    case 2: Launch<2>(xv, wv, y, nn, chunks, accumulate, stream); break;
    case 3: Launch<3>(xv, wv, y, nn, chunks, accumulate, stream); break;
    case 4: Launch<4>(xv, wv, y, nn, chunks, accumulate, stream); break;
    case 5: Launch<5>(xv, wv, y, nn, chunks, accumulate, stream); break;
    case 6: Launch<6>(xv, wv, y, nn, chunks, accumulate, stream); break;
    case 7: Launch<7>(xv, wv, y, nn, chunks, accumulate, stream); break;
    default: Launch<8>(xv, wv, y, nn, chunks, accumulate, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
