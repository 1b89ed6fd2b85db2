#include "kernels/cuda/decode_ops.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float LoadBf16(const bf16* p) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
}

unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

__global__ void EmbedRowsKernel(const bf16* table, const int32_t* ids, float* out, int64_t m,
                                int64_t d) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < m * d;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / d, col = i % d;
    out[i] = LoadBf16(table + static_cast<int64_t>(ids[row]) * d + col);
  }
}

// One RoPE rotation of the pair (a, b) into r[f], r[f + half], the angle and its sine/cosine in
// double. Shared by RopeKernel and SplitQkvRopeKernel so the two compile to the same arithmetic.
__device__ __forceinline__ void Rotate(float* r, int64_t f, int64_t half, float a, float b,
                                       int64_t position, float inv_freq) {
  double s, c;
  sincos(static_cast<double>(position) * static_cast<double>(inv_freq), &s, &c);
  const double da = a, db = b;
  r[f] = static_cast<float>(da * c - db * s);
  r[f + half] = static_cast<float>(db * c + da * s);
}

__global__ void RopeKernel(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
                           int64_t heads, int64_t half) {
  const int64_t pairs = n * heads * half;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pairs;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t f = i % half;
    const int64_t row = i / half;  // t * heads + h
    const int64_t t = row / heads;
    float* r = x + row * 2 * half;
    Rotate(r, f, half, r[f], r[f + half], positions[t], inv_freq[f]);
  }
}

// One thread per pair (f, f + half) of a head of a row: q and k heads rotate, v heads copy.
__global__ void SplitQkvRopeKernel(const float* qkv, const float* bias, const int64_t* positions,
                                   const float* inv_freq, float* q, float* k, float* v, int64_t m,
                                   int64_t heads, int64_t kv_heads, int64_t half) {
  const int64_t all_heads = heads + 2 * kv_heads;
  const int64_t pairs = m * all_heads * half;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pairs;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t f = i % half;
    const int64_t head_row = i / half;  // t * all_heads + h
    const int64_t t = head_row / all_heads, h = head_row % all_heads;
    const float* src = qkv + head_row * 2 * half;
    float a = src[f], b = src[f + half];
    if (bias != nullptr) {
      a += bias[h * 2 * half + f];
      b += bias[h * 2 * half + f + half];
    }
    float* dst;
    if (h < heads) {
      dst = q + (t * heads + h) * 2 * half;
    } else if (h < heads + kv_heads) {
      dst = k + (t * kv_heads + h - heads) * 2 * half;
    } else {
      dst = v + (t * kv_heads + h - heads - kv_heads) * 2 * half;
      dst[f] = a;
      dst[f + half] = b;
      continue;
    }
    Rotate(dst, f, half, a, b, positions[t], inv_freq[f]);
  }
}

__global__ void AddKernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] += x[i];
  }
}

__global__ void AddBiasKernel(float* y, const float* bias, int64_t m, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < m * n;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] += bias[i % n];
  }
}

// splitmix64's finaliser: a well-mixed 64-bit hash of the element's counter.
__host__ __device__ __forceinline__ uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void FillRandomKernel(bf16* w, int64_t n, uint64_t seed, float mean, float std_dev) {
  __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(w);
  const uint64_t key = Mix64(seed + 0x9e3779b97f4a7c15ull);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    // The top 24 bits as a uniform on [0, 1), then centred and scaled to unit variance.
    const float u = static_cast<float>(Mix64(key ^ static_cast<uint64_t>(i)) >> 40) * 0x1p-24f;
    out[i] = __float2bfloat16_rn(mean + std_dev * (u - 0.5f) * 3.46410161514f);
  }
}

__global__ void CastKernel(const float* x, bf16* y, int64_t n) {
  __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(y);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16_rn(x[i]);
  }
}

// One block per row; ties go to the lowest index, as std::max_element on the host.
__global__ void ArgmaxKernel(const float* logits, int64_t vocab, int32_t* out) {
  __shared__ float best_value[kThreads];
  __shared__ int32_t best_index[kThreads];
  const float* row = logits + blockIdx.x * vocab;
  float value = -INFINITY;
  int32_t index = -1;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
    if (index < 0 || row[v] > value) {
      value = row[v];
      index = static_cast<int32_t>(v);
    }
  }
  best_value[threadIdx.x] = value;
  best_index[threadIdx.x] = index;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float ov = best_value[threadIdx.x + stride];
      const int32_t oi = best_index[threadIdx.x + stride];
      const int32_t mi = best_index[threadIdx.x];
      if (oi >= 0 && (mi < 0 || ov > best_value[threadIdx.x] ||
                      (ov == best_value[threadIdx.x] && oi < mi))) {
        best_value[threadIdx.x] = ov;
        best_index[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = best_index[0];
}

// One block per (problem, query head): rows in tiles of kTile, an online softmax across tiles.
// Each warp scores rows (lanes split head_dim, a shuffle reduction), then every thread folds the
// tile into its own output dimension. Small and simple: a window is sinks + local tokens (~68-
// 1K rows); the long-context full-attention path is a separate kernel.
template <int kHeadDim>
__global__ void WindowAttentionKernel(const WindowProblem* problems, float scale) {
  constexpr int kTile = 128;
  constexpr int kWarps = 4;  // blockDim.x == 128
  __shared__ float q[kHeadDim];
  __shared__ float scores[kTile];
  const WindowProblem p = problems[blockIdx.x];
  const int head = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int d = tid; d < kHeadDim; d += blockDim.x) q[d] = p.q[head * kHeadDim + d];
  __syncthreads();
  float m = -INFINITY, l = 0.0f, acc = 0.0f;
  for (int start = 0; start < p.rows; start += kTile) {
    const int n = min(kTile, p.rows - start);
    for (int r = warp; r < n; r += kWarps) {
      const bf16* key = p.k + static_cast<int64_t>(start + r) * p.row_stride;
      float dot = 0.0f;
      for (int d = lane; d < kHeadDim; d += 32) dot += q[d] * LoadBf16(key + d);
      for (int offset = 16; offset > 0; offset >>= 1) {
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      }
      if (lane == 0) scores[r] = dot * scale;
    }
    __syncthreads();
    float tile_max = -INFINITY;
    for (int r = 0; r < n; ++r) tile_max = fmaxf(tile_max, scores[r]);
    const float new_m = fmaxf(m, tile_max);
    const float correction = __expf(m - new_m);  // 0 on the first tile (m = -inf)
    float tile_sum = 0.0f, tile_acc = 0.0f;
    for (int r = 0; r < n; ++r) {
      const float w = __expf(scores[r] - new_m);
      tile_sum += w;
      if (tid < kHeadDim) {
        tile_acc += w * LoadBf16(p.v + static_cast<int64_t>(start + r) * p.row_stride + tid);
      }
    }
    l = l * correction + tile_sum;
    acc = acc * correction + tile_acc;
    m = new_m;
    __syncthreads();  // every thread is done with `scores` before the next tile overwrites it
  }
  if (tid < kHeadDim) p.out[head * kHeadDim + tid] = p.rows > 0 ? acc / l : 0.0f;
  if (tid == 0) p.lse[head] = p.rows > 0 ? m + logf(l) : -INFINITY;
}

// One block per state: every thread reads both lse values before thread 0 overwrites lse_a.
__global__ void MergeStatesKernel(float* out_a, float* lse_a, const float* out_b,
                                  const float* lse_b, int64_t head_dim) {
  const int64_t s = blockIdx.x;
  const float la = lse_a[s], lb = lse_b[s];
  __syncthreads();
  if (lb == -INFINITY) return;  // b is empty: a stays as it is
  float* oa = out_a + s * head_dim;
  const float* ob = out_b + s * head_dim;
  if (la == -INFINITY) {
    for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) oa[d] = ob[d];
    if (threadIdx.x == 0) lse_a[s] = lb;
    return;
  }
  const float m = fmaxf(la, lb);
  const float wa = expf(la - m), wb = expf(lb - m);
  const float inv = 1.0f / (wa + wb);
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    oa[d] = (wa * oa[d] + wb * ob[d]) * inv;
  }
  if (threadIdx.x == 0) lse_a[s] = m + logf(wa + wb);
}

// One block per (item, head): the chunks' maximum lse, then every thread sums its dimensions'
// weighted outputs over the chunks.
__global__ void MergeChunksKernel(const float* chunk_out, const float* chunk_lse,
                                  const int32_t* chunk_begin, int group, int64_t head_dim,
                                  float* out, float* lse) {
  const int64_t item = blockIdx.x;
  const int head = blockIdx.y;
  const int32_t begin = chunk_begin[item], end = chunk_begin[item + 1];
  float m = -INFINITY;
  for (int32_t c = begin; c < end; ++c) m = fmaxf(m, chunk_lse[c * group + head]);
  float* o = out + (item * group + head) * head_dim;
  if (m == -INFINITY) {
    for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = 0.0f;
    if (threadIdx.x == 0) lse[item * group + head] = -INFINITY;
    return;
  }
  float total = 0.0f;
  for (int32_t c = begin; c < end; ++c) total += __expf(chunk_lse[c * group + head] - m);
  const float inv = 1.0f / total;
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int32_t c = begin; c < end; ++c) {
      const float w = __expf(chunk_lse[c * group + head] - m);
      acc += w * chunk_out[(static_cast<int64_t>(c) * group + head) * head_dim + d];
    }
    o[d] = acc * inv;
  }
  if (threadIdx.x == 0) lse[item * group + head] = m + logf(total);
}

}  // namespace

cudaError_t EmbedRows(const bf16* table, const int32_t* ids, float* out, int64_t m, int64_t d,
                      cudaStream_t stream) {
  if (m == 0 || d == 0) return cudaSuccess;
  EmbedRowsKernel<<<GridFor(m * d), kThreads, 0, stream>>>(table, ids, out, m, d);
  return cudaGetLastError();
}

cudaError_t ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
                      int64_t heads, int64_t head_dim, cudaStream_t stream) {
  if (head_dim % 2 != 0) return cudaErrorInvalidValue;
  const int64_t pairs = n * heads * (head_dim / 2);
  if (pairs == 0) return cudaSuccess;
  RopeKernel<<<GridFor(pairs), kThreads, 0, stream>>>(x, positions, inv_freq, n, heads,
                                                      head_dim / 2);
  return cudaGetLastError();
}

cudaError_t SplitQkvRope(const float* qkv, const float* bias, const int64_t* positions,
                         const float* inv_freq, float* q, float* k, float* v, int64_t m,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  if (head_dim % 2 != 0) return cudaErrorInvalidValue;
  const int64_t pairs = m * (heads + 2 * kv_heads) * (head_dim / 2);
  if (pairs == 0) return cudaSuccess;
  SplitQkvRopeKernel<<<GridFor(pairs), kThreads, 0, stream>>>(qkv, bias, positions, inv_freq, q, k,
                                                              v, m, heads, kv_heads, head_dim / 2);
  return cudaGetLastError();
}

cudaError_t AddInPlace(float* y, const float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  AddKernel<<<GridFor(n), kThreads, 0, stream>>>(y, x, n);
  return cudaGetLastError();
}

cudaError_t AddBiasRows(float* y, const float* bias, int64_t m, int64_t n, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  AddBiasKernel<<<GridFor(m * n), kThreads, 0, stream>>>(y, bias, m, n);
  return cudaGetLastError();
}

cudaError_t FillRandomBf16(bf16* w, int64_t n, uint64_t seed, float mean, float std_dev,
                           cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  FillRandomKernel<<<GridFor(n), kThreads, 0, stream>>>(w, n, seed, mean, std_dev);
  return cudaGetLastError();
}

cudaError_t CastToBf16(const float* x, bf16* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  CastKernel<<<GridFor(n), kThreads, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}

cudaError_t ArgmaxRows(const float* logits, int64_t rows, int64_t vocab, int32_t* out,
                       cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (vocab <= 0 || rows > 2147483647) return cudaErrorInvalidValue;
  ArgmaxKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab, out);
  return cudaGetLastError();
}

cudaError_t WindowAttention(const WindowProblem* problems, int64_t num_problems, int64_t group,
                            int64_t head_dim, float scale, cudaStream_t stream) {
  if (num_problems == 0) return cudaSuccess;
  if (group <= 0 || group > 65535 || num_problems > 2147483647) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(num_problems), static_cast<unsigned>(group));
  switch (head_dim) {
    case 64:
      WindowAttentionKernel<64><<<grid, 128, 0, stream>>>(problems, scale);
      break;
    case 128:
      WindowAttentionKernel<128><<<grid, 128, 0, stream>>>(problems, scale);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t MergeStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                        int64_t states, int64_t head_dim, cudaStream_t stream) {
  if (states == 0) return cudaSuccess;
  if (states > 2147483647) return cudaErrorInvalidValue;
  const int threads = static_cast<int>(std::min<int64_t>(128, std::max<int64_t>(32, head_dim)));
  MergeStatesKernel<<<static_cast<unsigned>(states), threads, 0, stream>>>(out_a, lse_a, out_b,
                                                                         lse_b, head_dim);
  return cudaGetLastError();
}

cudaError_t MergeChunks(const float* chunk_out, const float* chunk_lse,
                        const int32_t* chunk_begin, int64_t items, int64_t group,
                        int64_t head_dim, float* out, float* lse, cudaStream_t stream) {
  if (items == 0) return cudaSuccess;
  if (items > 2147483647 || group < 1 || group > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>(group));
  const int threads = static_cast<int>(std::min<int64_t>(128, std::max<int64_t>(32, head_dim)));
  MergeChunksKernel<<<grid, threads, 0, stream>>>(chunk_out, chunk_lse, chunk_begin,
                                                  static_cast<int>(group), head_dim, out, lse);
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
