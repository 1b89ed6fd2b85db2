#include "kernels/reference/reference_ops.h"

#include "kernels/reference/merge_state.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace fluxion::kernels::reference {

void MatMul(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
            int64_t k, bool accumulate) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = bias ? bias[j] : 0.0;
      for (int64_t t = 0; t < k; ++t) acc += double(x[i * k + t]) * w[j * k + t];
      y[i * n + j] = static_cast<float>(acc + (accumulate ? y[i * n + j] : 0.0));
    }
  }
}

void RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += double(x[i * d + j]) * x[i * d + j];
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    for (int64_t j = 0; j < d; ++j) y[i * d + j] = static_cast<float>(x[i * d + j] * inv * weight[j]);
  }
}

void ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
               int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      float* row = x + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const double angle = double(positions[t]) * inv_freq[i];
        const double c = std::cos(angle), s = std::sin(angle);
        const double a = row[i], b = row[i + half];
        row[i] = static_cast<float>(a * c - b * s);
        row[i + half] = static_cast<float>(b * c + a * s);
      }
    }
  }
}

void SiluMul(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    out[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
  }
}

void CausalAttention(const float* q, const float* k, const float* v, float* out,
                     const AttentionParams& p) {
  const int64_t d = p.head_dim, hq = p.num_heads, hkv = p.num_kv_heads;
  const int64_t group = hq / hkv;
  std::vector<double> scores;
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t keys = p.pos0 + i + 1;
    scores.assign(keys, 0.0);
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kvh = h / group;
      const float* qrow = q + (i * hq + h) * d;
      double max_s = -INFINITY;
      for (int64_t j = 0; j < keys; ++j) {
        const float* krow = k + (j * hkv + kvh) * d;
        double s = 0;
        for (int64_t t = 0; t < d; ++t) s += double(qrow[t]) * krow[t];
        scores[j] = s * p.scale;
        max_s = std::max(max_s, scores[j]);
      }
      double denom = 0;
      for (int64_t j = 0; j < keys; ++j) denom += (scores[j] = std::exp(scores[j] - max_s));
      float* orow = out + (i * hq + h) * d;
      for (int64_t t = 0; t < d; ++t) {
        double acc = 0;
        for (int64_t j = 0; j < keys; ++j) acc += scores[j] * v[(j * hkv + kvh) * d + t];
        orow[t] = static_cast<float>(acc / denom);
      }
    }
  }
}

void PagedAttention(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                    const DecodeQuery& q, const AttentionState& state) {
  const int64_t d = kv.head_dim;
  for (int64_t g = 0; g < q.group; ++g) {
    const float* qg = q.q + g * d;
    std::vector<double> scores;
    std::vector<const bf16*> v_rows;
    for (int64_t s = 0; s < num_spans; ++s) {
      for (int32_t r = spans[s].first_row; r < spans[s].first_row + spans[s].rows; ++r) {
        const bf16* k = kv.keys(spans[s].page) + r * d;
        double dot = 0;
        for (int64_t t = 0; t < d; ++t) dot += double(qg[t]) * Bf16ToFloat(k[t]);
        scores.push_back(dot * q.scale);
        v_rows.push_back(kv.values(spans[s].page) + r * d);
      }
    }
    float* out = state.out + g * d;
    if (scores.empty()) {
      std::fill(out, out + d, 0.0f);
      state.lse[g] = -INFINITY;
      continue;
    }
    double m = -INFINITY;
    for (double x : scores) m = std::max(m, x);
    double l = 0;
    std::vector<double> acc(d, 0.0);
    for (size_t j = 0; j < scores.size(); ++j) {
      const double p = std::exp(scores[j] - m);
      l += p;
      for (int64_t t = 0; t < d; ++t) acc[t] += p * Bf16ToFloat(v_rows[j][t]);
    }
    for (int64_t t = 0; t < d; ++t) out[t] = static_cast<float>(acc[t] / l);
    state.lse[g] = static_cast<float>(m + std::log(l));
  }
}

void MergeAttentionStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                          int64_t group, int64_t head_dim) {
  MergeStates(out_a, lse_a, out_b, lse_b, group, head_dim);
}

}  // namespace fluxion::kernels::reference
