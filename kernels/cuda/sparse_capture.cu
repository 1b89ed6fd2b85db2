#include "kernels/cuda/sparse_capture.h"

#include <cuda_bf16.h>

#include <cmath>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPairsPerBlock = 16;  // (tail row, query head) pairs whose q a score block holds

struct Shape {
  int64_t tokens, rows, num_heads, num_kv_heads, group, head_dim, page_tokens, pages_per_head;
  int64_t first;  // position of tail row 0
};

__device__ __forceinline__ const __nv_bfloat16* KeyRow(const LayerPages& p, int64_t head,
                                                       int64_t key) {
  const int64_t pt = p.page_tokens, d = p.head_dim;
  return reinterpret_cast<const __nv_bfloat16*>(p.base) +
         (head * p.pages_per_head + key / pt) * 2 * pt * d + (key % pt) * d;
}

__device__ float BlockSum(float x, float* red) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  float t = 0;
  for (int w = 0; w < kThreads / 32; ++w) t += red[w];
  return t;
}

__device__ float BlockMax(float x, float* red) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  float t = -INFINITY;
  for (int w = 0; w < kThreads / 32; ++w) t = fmaxf(t, red[w]);
  return t;
}

// scores[i][h][j] = scale * q(i, h) . k_j for j <= position(i), -inf after. One thread per key;
// blockIdx.y = KV head, blockIdx.z = a run of kPairsPerBlock (row, group member) pairs.
template <int D>
__global__ void ScoresKernel(LayerPages p, Shape s, const float* __restrict__ tail_q, float scale,
                             float* __restrict__ scores) {
  __shared__ float qs[kPairsPerBlock][D];
  const int64_t kvh = blockIdx.y;
  const int64_t pairs = s.rows * s.group;
  const int64_t pair0 = static_cast<int64_t>(blockIdx.z) * kPairsPerBlock;
  const int npairs = static_cast<int>(pairs - pair0 < kPairsPerBlock ? pairs - pair0 : kPairsPerBlock);
  for (int t = threadIdx.x; t < npairs * D; t += blockDim.x) {
    const int64_t pair = pair0 + t / D, i = pair / s.group, g = pair % s.group;
    qs[t / D][t % D] = tail_q[(i * s.num_heads + kvh * s.group + g) * D + t % D];
  }
  __syncthreads();
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= s.tokens) return;
  float k[D];
  const __nv_bfloat16* kr = KeyRow(p, kvh, j);
#pragma unroll
  for (int c = 0; c < D; ++c) k[c] = __bfloat162float(kr[c]);
  for (int t = 0; t < npairs; ++t) {
    const int64_t pair = pair0 + t, i = pair / s.group, g = pair % s.group;
    float dot = 0;
#pragma unroll
    for (int c = 0; c < D; ++c) dot = fmaf(qs[t][c], k[c], dot);
    scores[(i * s.num_heads + kvh * s.group + g) * s.tokens + j] =
        j <= s.first + i ? dot * scale : -INFINITY;
  }
}

// Per (row, query head): the softmax's max and normalizer, and its sink, local and entropy.
__global__ void RowStatsKernel(Shape s, TailCaptureParams c, const float* __restrict__ scores,
                               float2* __restrict__ mz, TailRowHeadStats* __restrict__ out) {
  __shared__ float red[kThreads / 32];
  const int64_t i = blockIdx.x / s.num_heads, h = blockIdx.x % s.num_heads;
  const float* row = scores + (i * s.num_heads + h) * s.tokens;
  const int64_t n = s.first + i + 1;
  const int64_t sink_end = c.sink_tokens < n ? c.sink_tokens : n;
  const int64_t local_begin = n - c.local_tokens > sink_end ? n - c.local_tokens : sink_end;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, row[j]);
  m = BlockMax(m, red);
  float z = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) z += expf(row[j] - m);
  z = BlockSum(z, red);
  float sink = 0, local = 0, entropy = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float a = expf(row[j] - m) / z;
    if (j < sink_end) sink += a;
    if (j >= local_begin) local += a;
    if (a > 0) entropy -= a * logf(a);
  }
  sink = BlockSum(sink, red);
  local = BlockSum(local, red);
  entropy = BlockSum(entropy, red);
  if (threadIdx.x == 0) {
    mz[blockIdx.x] = make_float2(m, z);
    out[blockIdx.x] = {sink, local, entropy};
  }
}

// best[i][kvh][j] = max over the group of the attention of row i on key j (0 past its position).
__global__ void BestKernel(Shape s, const float* __restrict__ scores, const float2* __restrict__ mz,
                           float* __restrict__ best) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t kvh = blockIdx.y, i = blockIdx.z;
  if (j >= s.tokens) return;
  float b = 0;
  if (j <= s.first + i) {
    for (int64_t g = 0; g < s.group; ++g) {
      const int64_t h = kvh * s.group + g;
      const float2 st = mz[i * s.num_heads + h];
      b = fmaxf(b, expf(scores[(i * s.num_heads + h) * s.tokens + j] - st.x) / st.y);
    }
  }
  best[(i * s.num_kv_heads + kvh) * s.tokens + j] = b;
}

// vertical[kvh][j] and slash[kvh][d], summed over the rows in row order (as the CPU capture).
__global__ void TablesKernel(Shape s, double decay, const float* __restrict__ best,
                             float* __restrict__ vertical, float* __restrict__ slash) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t kvh = blockIdx.y;
  if (j >= s.tokens) return;
  const int64_t last = s.first + s.rows - 1;
  float v = 0, sl = 0;
  for (int64_t i = 0; i < s.rows; ++i) {
    const int64_t pos = s.first + i;
    const double w = pow(decay, static_cast<double>(last - pos));
    const float* b = best + (i * s.num_kv_heads + kvh) * s.tokens;
    v += static_cast<float>(w * b[j]);
    if (pos - j >= 0) sl += static_cast<float>(w * b[pos - j]);
  }
  vertical[kvh * s.tokens + j] = v;
  slash[kvh * s.tokens + j] = sl;
}

// Per (row, KV head): the middle's mass and how many of its largest entries cover `coverage` of
// it, by a three-pass radix select over the (non-negative) values' bits with per-bin counts and
// sums: the CPU capture's sort-and-accumulate without sorting.
__global__ void NeedKernel(Shape s, TailCaptureParams c, const float* __restrict__ best,
                           TailRowMiddle* __restrict__ out) {
  constexpr int kBins = 2048;
  __shared__ unsigned cnt[kBins];
  __shared__ float sum[kBins];
  __shared__ float red[kThreads / 32];
  __shared__ unsigned chosen;
  __shared__ int done;
  __shared__ float above_sum;
  __shared__ unsigned long long above_cnt;
  const int64_t i = blockIdx.x / s.num_kv_heads, kvh = blockIdx.x % s.num_kv_heads;
  const float* row = best + (i * s.num_kv_heads + kvh) * s.tokens;
  const int64_t n = s.first + i + 1;
  const int64_t sink_end = c.sink_tokens < n ? c.sink_tokens : n;
  const int64_t local_begin = n - c.local_tokens > sink_end ? n - c.local_tokens : sink_end;
  float share = 0;
  for (int64_t j = sink_end + threadIdx.x; j < local_begin; j += blockDim.x) share += row[j];
  share = BlockSum(share, red);
  const int64_t middle = local_begin - sink_end;
  if (middle <= 0 || !(share > 0)) {
    if (threadIdx.x == 0) out[blockIdx.x] = {share, 0, middle};
    return;
  }
  const float target = static_cast<float>(c.coverage * share);
  if (threadIdx.x == 0) {
    above_sum = 0;
    above_cnt = 0;
    done = 0;
  }
  unsigned prefix = 0, mask = 0;
  const int shifts[3] = {21, 10, 0};
  const unsigned widths[3] = {11, 11, 10};
  for (int pass = 0; pass < 3; ++pass) {
    const unsigned bins = 1u << widths[pass];
    for (unsigned b = threadIdx.x; b < bins; b += blockDim.x) {
      cnt[b] = 0;
      sum[b] = 0;
    }
    __syncthreads();
    for (int64_t j = sink_end + threadIdx.x; j < local_begin; j += blockDim.x) {
      const unsigned u = __float_as_uint(row[j]);
      if ((u & mask) != prefix) continue;
      const unsigned b = (u >> shifts[pass]) & (bins - 1);
      atomicAdd(&cnt[b], 1u);
      atomicAdd(&sum[b], row[j]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int b = static_cast<int>(bins) - 1;
      for (; b >= 0; --b) {
        if (above_sum + sum[b] >= target) break;
        above_sum += sum[b];
        above_cnt += cnt[b];
      }
      if (b < 0) {
        done = 1;  // rounding left the whole middle short of the target: all of it is needed
      } else {
        chosen = static_cast<unsigned>(b);
      }
    }
    __syncthreads();
    if (done) break;
    prefix |= chosen << shifts[pass];
    mask |= (bins - 1) << shifts[pass];
  }
  if (threadIdx.x == 0) {
    int64_t needed = static_cast<int64_t>(above_cnt);
    if (!done) {
      const float v = __uint_as_float(prefix);
      const int64_t ties = cnt[chosen];
      int64_t take = ties;
      if (v > 0) {
        take = static_cast<int64_t>(ceilf((target - above_sum) / v));
        take = take < 1 ? 1 : (take > ties ? ties : take);
      }
      needed += take;
    }
    out[blockIdx.x] = {share, needed < middle ? needed : middle, middle};
  }
}

template <int D>
cudaError_t LaunchScores(const LayerPages& p, const Shape& s, const float* tail_q, float scale,
                         float* scores, cudaStream_t stream) {
  const int64_t pairs = s.rows * s.group;
  const dim3 grid(static_cast<unsigned>((s.tokens + kThreads - 1) / kThreads),
                  static_cast<unsigned>(s.num_kv_heads),
                  static_cast<unsigned>((pairs + kPairsPerBlock - 1) / kPairsPerBlock));
  ScoresKernel<D><<<grid, kThreads, 0, stream>>>(p, s, tail_q, scale, scores);
  return cudaGetLastError();
}

struct Scratch {
  float* scores;
  float* best;
  float2* mz;
};

Scratch Carve(void* base, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t tokens) {
  char* b = static_cast<char*>(base);
  Scratch s;
  s.scores = reinterpret_cast<float*>(b);
  b += sizeof(float) * rows * num_heads * tokens;
  s.best = reinterpret_cast<float*>(b);
  b += sizeof(float) * rows * num_kv_heads * tokens;
  s.mz = reinterpret_cast<float2*>(b);
  return s;
}

}  // namespace

size_t TailCaptureScratchBytes(int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                               int64_t tokens) {
  return sizeof(float) * rows * (num_heads + num_kv_heads) * tokens +
         sizeof(float2) * rows * num_heads;
}

cudaError_t CaptureLayerTail(const LayerPages& pages, const float* tail_q,
                             const TailCaptureParams& c, void* scratch, float* vertical,
                             float* slash, TailRowHeadStats* row_heads, TailRowMiddle* middles,
                             cudaStream_t stream) {
  if (c.rows < 1 || c.rows > kMaxTailRows || c.rows > c.tokens || pages.num_kv_heads <= 0 ||
      c.num_heads % pages.num_kv_heads != 0 ||
      c.tokens > pages.pages_per_head * pages.page_tokens) {
    return cudaErrorInvalidValue;
  }
  Shape s{c.tokens,          c.rows,           c.num_heads,        pages.num_kv_heads,
          c.num_heads / pages.num_kv_heads,    pages.head_dim,     pages.page_tokens,
          pages.pages_per_head, c.tokens - c.rows};
  Scratch sc = Carve(scratch, c.rows, c.num_heads, pages.num_kv_heads, c.tokens);
  cudaError_t e;
  switch (pages.head_dim) {
    case 32: e = LaunchScores<32>(pages, s, tail_q, c.scale, sc.scores, stream); break;
    case 64: e = LaunchScores<64>(pages, s, tail_q, c.scale, sc.scores, stream); break;
    case 128: e = LaunchScores<128>(pages, s, tail_q, c.scale, sc.scores, stream); break;
    default: return cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return e;
  RowStatsKernel<<<static_cast<unsigned>(c.rows * c.num_heads), kThreads, 0, stream>>>(
      s, c, sc.scores, sc.mz, row_heads);
  const unsigned key_blocks = static_cast<unsigned>((c.tokens + kThreads - 1) / kThreads);
  BestKernel<<<dim3(key_blocks, static_cast<unsigned>(s.num_kv_heads),
                    static_cast<unsigned>(c.rows)),
               kThreads, 0, stream>>>(s, sc.scores, sc.mz, sc.best);
  TablesKernel<<<dim3(key_blocks, static_cast<unsigned>(s.num_kv_heads)), kThreads, 0, stream>>>(
      s, c.decay, sc.best, vertical, slash);
  NeedKernel<<<static_cast<unsigned>(c.rows * s.num_kv_heads), kThreads, 0, stream>>>(
      s, c, sc.best, middles);
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
