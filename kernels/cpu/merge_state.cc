#include "kernels/cpu/merge_state.h"

#include <algorithm>
#include <cmath>

namespace fluxion::kernels::cpu {

void MergeStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b, int64_t rows,
                 int64_t head_dim) {
  for (int64_t g = 0; g < rows; ++g) {
    const float la = lse_a[g], lb = lse_b[g];
    float* oa = out_a + g * head_dim;
    const float* ob = out_b + g * head_dim;
    if (lb == -INFINITY) continue;  // b empty: identity (a empty too: stays empty)
    if (la == -INFINITY) {          // a empty: take b, without exp(-inf - -inf) = NaN
      std::copy_n(ob, head_dim, oa);
      lse_a[g] = lb;
      continue;
    }
    const float m = std::max(la, lb);
    const float wa = std::exp(la - m), wb = std::exp(lb - m);
    const float inv = 1.0f / (wa + wb);
#pragma omp simd
    for (int64_t t = 0; t < head_dim; ++t) oa[t] = (wa * oa[t] + wb * ob[t]) * inv;
    lse_a[g] = m + std::log(wa + wb);
  }
}

}  // namespace fluxion::kernels::cpu
