#include "kernels/cpu/cpu_ops.h"

#include "kernels/cpu/math_avx2.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fluxion::kernels::cpu {
namespace {

// Query rows per attention tile and keys per chunk of it: large enough that sgemm runs near peak,
// small enough that one chunk's scores (kQueryTile x kKeyChunk floats, 128 KiB) stay in L2. The
// first version scored a 64-row tile against every key at once (4 MiB per tile at 16K, to DRAM
// and back three times) with a scalar softmax: 41 s for a 16K prompt of the tiny model on one
// devbox core; this one takes 16 s (64 x 512 chunks: 4.4 s at 8K, 128 x 256: 4.1 s).
constexpr int64_t kQueryTile = 128;
constexpr int64_t kKeyChunk = 256;

}  // namespace

void SetNumThreads(int threads) {
  if (threads <= 0) threads = omp_get_num_procs();
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
}

int NumThreads() { return omp_get_max_threads(); }

const char* BlasCoreName() { return openblas_get_corename(); }

void MatMul(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
            int64_t k, bool accumulate) {
  const float beta = accumulate ? 1.0f : 0.0f;
  if (m == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, w, k, x, 1, beta, y, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, k, w, k, beta, y, n);
  }
  if (bias != nullptr) {
    for (int64_t i = 0; i < m; ++i) Add(bias, y + i * n, n);
  }
}

void RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m, int64_t d) {
#pragma omp parallel for if (m > 4)
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * d;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < d; ++j) ss += row[j] * row[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
    float* out = y + i * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) out[j] = row[j] * inv * weight[j];
  }
}

void ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
               int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel if (n > 4)
  {
    std::vector<float> cos_t(half), sin_t(half);
#pragma omp for
    for (int64_t t = 0; t < n; ++t) {
      // fp32 angle, as transformers computes it (position * inv_freq in float32).
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(positions[t]) * inv_freq[i];
        cos_t[i] = std::cos(angle);
        sin_t[i] = std::sin(angle);
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* row = x + (t * heads + h) * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = row[i], b = row[i + half];
          row[i] = a * cos_t[i] - b * sin_t[i];
          row[i + half] = b * cos_t[i] + a * sin_t[i];
        }
      }
    }
  }
}

void SiluMul(const float* gate, const float* up, float* out, int64_t n) {
#pragma omp parallel for simd if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void Add(const float* x, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] += x[i];
}

void AccumulateMoments(const float* x, int64_t n, int64_t d, double* sums, double* outer) {
  if (n <= 0) return;
  std::vector<float> c(d * d, 0.0f);
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, d, n, 1.0f, x, d, 0.0f, c.data(), d);
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = i; j < d; ++j) {
      outer[i * d + j] += c[i * d + j];
      if (j != i) outer[j * d + i] += c[i * d + j];
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < d; ++i) sums[i] += x[r * d + i];
  }
}

void CausalAttention(const float* q, const float* k, const float* v, float* out,
                     const AttentionParams& p) {
  const int64_t d = p.head_dim, hq = p.num_heads, hkv = p.num_kv_heads;
  const int64_t group = hq / hkv;
  const int64_t tiles = (p.n + kQueryTile - 1) / kQueryTile;
  const int64_t q_stride = hq * d;   // between consecutive tokens' rows of one head
  const int64_t kv_stride = hkv * d;
#pragma omp parallel
  {
    // Sized for the largest tile this call has: a decode step (n = 1) is a 1-row tile.
    const int64_t tile_rows = std::min(kQueryTile, p.n);
    std::vector<float> scores(tile_rows * kKeyChunk);
    std::vector<float> acc(tile_rows * d), running_max(tile_rows), running_sum(tile_rows);
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t h = 0; h < hq; ++h) {
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * kQueryTile;
        const int64_t rows = std::min(kQueryTile, p.n - i0);
        const int64_t keys = p.pos0 + i0 + rows;  // the tile's last query sees this many keys
        const float* qt = q + i0 * q_stride + h * d;
        const float* kh = k + (h / group) * d;
        const float* vh = v + (h / group) * d;
        std::fill(acc.begin(), acc.begin() + rows * d, 0.0f);
        std::fill(running_max.begin(), running_max.end(), -INFINITY);
        std::fill(running_sum.begin(), running_sum.end(), 0.0f);
        // Flash-style: one key chunk's scores at a time (they stay in L2 at any context), the
        // tile's output kept as an unnormalised sum rescaled whenever a row's maximum grows.
        for (int64_t c0 = 0; c0 < keys; c0 += kKeyChunk) {
          const int64_t cn = std::min(kKeyChunk, keys - c0);
          const float* kc = kh + c0 * kv_stride;
          const float* vc = vh + c0 * kv_stride;
          // scores[rows][cn] = scale * q_tile . K_chunk^T. One row (a decode step) goes through
          // sgemv: sgemm would pack the whole chunk of keys first, which cost more than the
          // product itself at M = 1.
          if (rows == 1) {
            cblas_sgemv(CblasRowMajor, CblasNoTrans, cn, d, p.scale, kc, kv_stride, qt, 1, 0.0f,
                        scores.data(), 1);
          } else {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cn, d, p.scale, qt,
                        q_stride, kc, kv_stride, 0.0f, scores.data(), cn);
          }
          for (int64_t r = 0; r < rows; ++r) {
            float* s = scores.data() + r * cn;
            // causal mask: query i0 + r sees keys [0, pos0 + i0 + r]
            const int64_t visible = std::clamp<int64_t>(p.pos0 + i0 + r + 1 - c0, 0, cn);
            if (visible > 0) {
              const float new_max = std::max(running_max[r], MaxOf(s, visible));
              const float correction = std::exp(running_max[r] - new_max);  // 0 at first
              running_sum[r] =
                  running_sum[r] * correction + ExpShiftedInPlace(s, visible, new_max);
              running_max[r] = new_max;
              if (correction != 1.0f) {
                for (int64_t i = 0; i < d; ++i) acc[r * d + i] *= correction;
              }
            }
            std::fill(s + visible, s + cn, 0.0f);
          }
          // acc[rows][d] += P_chunk . V_chunk
          if (rows == 1) {
            cblas_sgemv(CblasRowMajor, CblasTrans, cn, d, 1.0f, vc, kv_stride, scores.data(), 1,
                        1.0f, acc.data(), 1);
          } else {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, cn, 1.0f,
                        scores.data(), cn, vc, kv_stride, 1.0f, acc.data(), d);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float inv = 1.0f / running_sum[r];  // every row sees at least its own key
          float* o = out + (i0 + r) * q_stride + h * d;
          for (int64_t i = 0; i < d; ++i) o[i] = acc[r * d + i] * inv;
        }
      }
    }
  }
}

}  // namespace fluxion::kernels::cpu
