#include "kernels/reference/merge_state.h"

#include <algorithm>
#include <cmath>

namespace fluxion::kernels::reference {

void MergeStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b, int64_t rows,
                 int64_t head_dim) {
  for (int64_t g = 0; g < rows; ++g) {
    const double la = lse_a[g], lb = lse_b[g];
    float* oa = out_a + g * head_dim;
    const float* ob = out_b + g * head_dim;
    if (lb == -INFINITY) continue;  // b empty: identity (a empty too: stays empty)
    if (la == -INFINITY) {          // a empty: take b
      std::copy_n(ob, head_dim, oa);
      lse_a[g] = lse_b[g];
      continue;
    }
    const double m = std::max(la, lb);
    const double wa = std::exp(la - m), wb = std::exp(lb - m);
    for (int64_t t = 0; t < head_dim; ++t) {
      oa[t] = static_cast<float>((wa * oa[t] + wb * ob[t]) / (wa + wb));
    }
    lse_a[g] = static_cast<float>(m + std::log(wa + wb));
  }
}

}  // namespace fluxion::kernels::reference
