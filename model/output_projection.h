// A layer's attention output projection W_O as the sparse side needs it: the norm of one KV head's
// slice of it applied to a vector, and of the whole layer's. This is what turns an attention
// output difference into the error Fluxion budgets by (ALGORITHMS.md §2.4.2):
//
//   e_h = ||W_O^h (o_h - ô_h)|| / ||sum_h' W_O^h' o_h'||
//
// with W_O^h the columns of W_O that read KV head h's query group. The model fills it (it holds
// the weights; Model::output_projection), decode/sparse reads it (the online error guard,
// decode/sparse/error_guard.h) and so does the offline label maker (`fluxion eval attention
// --head-table`, bench/captured_attention_eval.cc): one definition of e_h for both. It lives in
// model/ so that dependencies point one way (decode -> model).
//
// Immutable after construction; it borrows the weight matrices, which must outlive it.
#ifndef FLUXION_MODEL_OUTPUT_PROJECTION_H_
#define FLUXION_MODEL_OUTPUT_PROJECTION_H_

#include <cstdint>
#include <utility>
#include <vector>

namespace fluxion::model {

class OutputProjection {
 public:
  // w_o[layer]: [hidden][width] fp32, row-major as nn.Linear stores it (width = num_heads *
  // head_dim). A null entry is the identity (hidden == width): timing benches over synthetic
  // heads, which have no W_O, measure the relative output error.
  OutputProjection(int64_t hidden, int64_t width, std::vector<const float*> w_o)
      : hidden_(hidden), width_(width), w_o_(std::move(w_o)) {}
  // The identity at every layer (see above).
  static OutputProjection Identity(int64_t num_layers, int64_t width) {
    return OutputProjection(width, width, std::vector<const float*>(num_layers, nullptr));
  }

  int64_t num_layers() const { return static_cast<int64_t>(w_o_.size()); }
  int64_t width() const { return width_; }

  // ||W_O[:, col0 : col0 + n] x|| for layer `layer`; x: [n]. REQUIRES: col0 + n <= width.
  double SliceNorm(int layer, int64_t col0, const double* x, int64_t n) const;
  double SliceNorm(int layer, int64_t col0, const float* x, int64_t n) const;
  // ||W_O x||, x: [width].
  double Norm(int layer, const float* x) const;

 private:
  template <typename T>
  double SliceNormOf(int layer, int64_t col0, const T* x, int64_t n) const;
  int64_t hidden_, width_;
  std::vector<const float*> w_o_;  // [layer]
};

// e_h of one KV head (see the header): ||W_O^h (exact - approx)|| / total, where exact and approx
// are the head's group outputs ([n] = group * head_dim, starting at column col0) and total is
// ||sum_h' W_O^h' o_h'|| of the layer. 0 when total is 0.
double HeadOutputError(const OutputProjection& w, int layer, int64_t col0, const double* exact,
                       const double* approx, int64_t n, double total);
double HeadOutputError(const OutputProjection& w, int layer, int64_t col0, const float* exact,
                       const float* approx, int64_t n, double total);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_OUTPUT_PROJECTION_H_
