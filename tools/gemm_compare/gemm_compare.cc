// One-off measurement behind docs/DEPENDENCIES.md "CPU matrix products": OpenBLAS against oneDNN
// for the fp32 products the model runtime does (decode GEMV, prefill GEMM), same inputs, same
// process, interleaved. Not part of the product; run with tools/gemm_compare/run.sh.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  struct Shape {
    const char* what;
    int m, n, k;
  };
  // Qwen2.5-0.5B shapes: MLP up (896 -> 4864) and down, LM head; decode (m = 1) and a
  // 512-token prefill chunk.
  const Shape shapes[] = {{"decode mlp up", 1, 4864, 896},    {"decode mlp down", 1, 896, 4864},
                          {"decode lm head", 1, 151936, 896}, {"prefill mlp up", 512, 4864, 896},
                          {"prefill mlp down", 512, 896, 4864}};
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0, 1);
  std::printf("%-18s %7s | %12s %12s | %8s\n", "shape", "threads", "openblas ms", "onednn ms",
              "ratio");
  for (int threads : {1, omp_get_num_procs()}) {
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    for (const Shape& s : shapes) {
      std::vector<float> x(s.m * s.k), w(s.n * s.k), y1(s.m * s.n), y2(s.m * s.n);
      for (float& v : x) v = normal(rng);
      for (float& v : w) v = normal(rng);
      // y[m][n] = x[m][k] . w[n][k]^T, w as nn.Linear stores it.
      dnnl::memory::desc xd({s.m, s.k}, dnnl::memory::data_type::f32, {s.k, 1});
      dnnl::memory::desc wd({s.k, s.n}, dnnl::memory::data_type::f32, {1, s.k});
      dnnl::memory::desc yd({s.m, s.n}, dnnl::memory::data_type::f32, {s.n, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(xd, wd, yd), engine);  // oneDNN 2.6 API
      dnnl::matmul mm(pd);
      dnnl::memory xm(xd, engine, x.data()), wm(wd, engine, w.data()), ym(yd, engine, y2.data());
      std::vector<double> t1, t2;
      for (int r = 0; r < 12; ++r) {
        auto a = std::chrono::steady_clock::now();
        if (s.m == 1) {
          cblas_sgemv(CblasRowMajor, CblasNoTrans, s.n, s.k, 1.0f, w.data(), s.k, x.data(), 1,
                      0.0f, y1.data(), 1);
        } else {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.m, s.n, s.k, 1.0f, x.data(), s.k,
                      w.data(), s.k, 0.0f, y1.data(), s.n);
        }
        auto b = std::chrono::steady_clock::now();
        mm.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}});
        stream.wait();
        auto c = std::chrono::steady_clock::now();
        if (r >= 2) {
          t1.push_back(std::chrono::duration<double, std::milli>(b - a).count());
          t2.push_back(std::chrono::duration<double, std::milli>(c - b).count());
        }
      }
      double err = 0, ref = 0;
      for (size_t i = 0; i < y1.size(); ++i) {
        err += (y1[i] - y2[i]) * (y1[i] - y2[i]);
        ref += y1[i] * y1[i];
      }
      if (std::sqrt(err / ref) > 1e-4) {
        std::printf("results differ for %s\n", s.what);
        return 1;
      }
      std::printf("%-18s %7d | %12.3f %12.3f | %7.2fx\n", s.what, threads, Median(t1), Median(t2),
                  Median(t2) / Median(t1));
    }
  }
  return 0;
}
