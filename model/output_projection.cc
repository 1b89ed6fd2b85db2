#include "model/output_projection.h"

#include <cmath>

namespace fluxion::model {

template <typename T>
double OutputProjection::SliceNormOf(int layer, int64_t col0, const T* x, int64_t n) const {
  const float* w = w_o_[layer];
  double sum = 0;
  if (w == nullptr) {  // the identity
    for (int64_t c = 0; c < n; ++c) sum += static_cast<double>(x[c]) * x[c];
    return std::sqrt(sum);
  }
  for (int64_t r = 0; r < hidden_; ++r) {
    const float* wr = w + r * width_ + col0;
    double y = 0;
    for (int64_t c = 0; c < n; ++c) y += wr[c] * static_cast<double>(x[c]);
    sum += y * y;
  }
  return std::sqrt(sum);
}

double OutputProjection::SliceNorm(int layer, int64_t col0, const double* x, int64_t n) const {
  return SliceNormOf(layer, col0, x, n);
}

double OutputProjection::SliceNorm(int layer, int64_t col0, const float* x, int64_t n) const {
  return SliceNormOf(layer, col0, x, n);
}

double OutputProjection::Norm(int layer, const float* x) const {
  return SliceNormOf(layer, 0, x, width_);
}

namespace {

template <typename T>
double HeadErrorOf(const OutputProjection& w, int layer, int64_t col0, const T* exact,
                   const T* approx, int64_t n, double total) {
  if (!(total > 0)) return 0.0;
  std::vector<double> diff(n);
  for (int64_t i = 0; i < n; ++i) diff[i] = static_cast<double>(exact[i]) - approx[i];
  return w.SliceNorm(layer, col0, diff.data(), n) / total;
}

}  // namespace

double HeadOutputError(const OutputProjection& w, int layer, int64_t col0, const double* exact,
                       const double* approx, int64_t n, double total) {
  return HeadErrorOf(w, layer, col0, exact, approx, n, total);
}

double HeadOutputError(const OutputProjection& w, int layer, int64_t col0, const float* exact,
                       const float* approx, int64_t n, double total) {
  return HeadErrorOf(w, layer, col0, exact, approx, n, total);
}

}  // namespace fluxion::model
