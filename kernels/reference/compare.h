// How far a kernel's output is from its reference: the one error measure the conformance tests,
// the benchmarks' pre-timing check and the CUDA tests share (ggml's max_nmse_err, in L2 form).
#ifndef FLUXION_KERNELS_REFERENCE_COMPARE_H_
#define FLUXION_KERNELS_REFERENCE_COMPARE_H_

#include <cmath>

#include "absl/types/span.h"

namespace fluxion::kernels::reference {

// |got - want|_2 / |want|_2 in double; the absolute L2 error when `want` is all zeros; infinity
// if `got` holds a NaN (an unwritten or poisoned output must never pass).
// REQUIRES: got.size() == want.size().
inline double RelativeL2Error(absl::Span<const float> got, absl::Span<const float> want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    const double diff = double(got[i]) - want[i];
    num += diff * diff;
    den += double(want[i]) * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace fluxion::kernels::reference

#endif  // FLUXION_KERNELS_REFERENCE_COMPARE_H_
