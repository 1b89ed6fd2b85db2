#include "kernels/cuda/gemm.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/gemv.h"

namespace fluxion::kernels::cuda {
namespace {

absl::Status CublasError(cublasStatus_t s, const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", cublasGetStatusName(s), " (",
                                          cublasGetStatusString(s), ")"));
}

// Written over between timed runs so that no candidate is timed reading its weights from L2 (60 MB
// on the H200, larger than the o product's 32 MB).
constexpr size_t kFlushBytes = size_t{128} << 20;
constexpr int kTimedRuns = 3;
// A candidate further than this from the default's result (relative to its largest magnitude) is
// wrong, not reordered: fp32 accumulation orders differ by ~1e-6 at these k.
constexpr double kCandidateTolerance = 1e-3;

// cuBLASLt's heuristics assume 256-byte aligned operands (the preference's default), as cudaMalloc
// gives; a product on a view at another offset runs the default (and is never tuned).
bool Aligned(const void* x, const void* w, const void* y) {
  auto ok = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 256 == 0; };
  return ok(x) && ok(w) && ok(y);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Gemm>> Gemm::Create(cudaStream_t stream, size_t workspace_bytes,
                                                   bool tune) {
  cublasHandle_t handle = nullptr;
  if (cublasStatus_t s = cublasCreate(&handle); s != CUBLAS_STATUS_SUCCESS) {
    return CublasError(s, "cublasCreate");
  }
  cublasLtHandle_t lt = nullptr;
  if (cublasStatus_t s = cublasLtCreate(&lt); s != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(handle);
    return CublasError(s, "cublasLtCreate");
  }
  void* workspace = nullptr;
  if (cudaError_t e = cudaMalloc(&workspace, workspace_bytes); e != cudaSuccess) {
    cublasLtDestroy(lt);
    cublasDestroy(handle);
    return absl::InternalError(
        absl::StrCat("cudaMalloc of the cuBLAS workspace: ", cudaGetErrorString(e)));
  }
  std::unique_ptr<Gemm> gemm(new Gemm(handle, lt, stream, workspace, workspace_bytes, tune));
  if (cublasStatus_t s = cublasSetStream(handle, stream); s != CUBLAS_STATUS_SUCCESS) {
    return CublasError(s, "cublasSetStream");
  }
  if (cublasStatus_t s = cublasSetWorkspace(handle, workspace, workspace_bytes);
      s != CUBLAS_STATUS_SUCCESS) {
    return CublasError(s, "cublasSetWorkspace");
  }
  return gemm;
}

Gemm::~Gemm() {
  for (auto& [shape, plan] : plans_) Destroy(&plan);
  cublasLtDestroy(lt_);
  cublasDestroy(handle_);
  cudaFree(workspace_);
}

void Gemm::Destroy(Plan* p) {
  if (p->op != nullptr) cublasLtMatmulDescDestroy(p->op);
  for (cublasLtMatrixLayout_t l : {p->a, p->b, p->c}) {
    if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
  }
  p->op = nullptr;
  p->a = p->b = p->c = nullptr;
  p->kind = Kind::kDefault;
}

cublasStatus_t Gemm::RunDefault(const bf16* x, const bf16* w, float* y, const Shape& s) {
  // Row-major y[m][n] is column-major y^T[n][m] = w[n][k] . x^T, where row-major w[n][k] is the
  // column-major k x n matrix (transposed in the product) and row-major x[m][k] the column-major
  // k x m matrix.
  const auto [m, n, k, accumulate] = s;
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  return cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                      static_cast<int>(k), &alpha, w, CUDA_R_16BF, static_cast<int>(k), x,
                      CUDA_R_16BF, static_cast<int>(k), &beta, y, CUDA_R_32F, static_cast<int>(n),
                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t Gemm::RunPlan(const Plan& p, const bf16* x, const bf16* w, float* y,
                             const Shape& s) {
  if (p.kind == Kind::kDefault || !Aligned(x, w, y)) return RunDefault(x, w, y, s);
  if (p.kind == Kind::kGemv) {
    const auto [m, n, k, accumulate] = s;
    return GemvBf16(x, w, y, m, n, k, accumulate, stream_) == cudaSuccess
               ? CUBLAS_STATUS_SUCCESS
               : CUBLAS_STATUS_EXECUTION_FAILED;
  }
  const float alpha = 1.0f, beta = std::get<3>(s) ? 1.0f : 0.0f;
  // The same column-major product as RunDefault: A = w (k x n, transposed), B = x (k x m), C = D
  // = y (n x m), in place.
  return cublasLtMatmul(lt_, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c, &p.algo,
                        workspace_, workspace_bytes_, stream_);
}

namespace {

// The largest |got[j] - want[j]| (NaN when either holds one).
double MaxDifference(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0;
  for (size_t j = 0; j < got.size(); ++j) {
    const double d = std::abs(double(got[j]) - want[j]);
    if (!(d <= diff)) diff = d;  // keeps a NaN
  }
  return diff;
}

}  // namespace

bool Gemm::LtCandidates(const Shape& s, Plan* lt, cublasLtMatmulHeuristicResult_t* results,
                        int* returned) {
  const auto [m, n, k, accumulate] = s;
  cublasLtMatmulPreference_t pref = nullptr;
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  uint64_t workspace = workspace_bytes_;
  const bool ok =
      cublasLtMatmulDescCreate(&lt->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(lt->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                     sizeof(trans_a)) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(lt->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                     sizeof(trans_b)) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&lt->a, CUDA_R_16BF, k, n, k) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&lt->b, CUDA_R_16BF, k, m, k) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&lt->c, CUDA_R_32F, n, m, n) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace, sizeof(workspace)) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulAlgoGetHeuristic(lt_, lt->op, lt->a, lt->b, lt->c, lt->c, pref,
                                     kTuneCandidates, results, returned) == CUBLAS_STATUS_SUCCESS;
  if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  return ok;
}

Gemm::Plan Gemm::Tune(const bf16* x, const bf16* w, const float* y, const Shape& s) {
  const auto [m, n, k, accumulate] = s;
  Plan best;
  best.what = "cublasGemmEx default";
  const size_t y_bytes = static_cast<size_t>(m * n) * sizeof(float);
  float* out = nullptr;
  void* flush = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  auto release = [&] {
    for (void* d : {static_cast<void*>(out), flush}) {
      if (d != nullptr) cudaFree(d);
    }
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    cudaGetLastError();  // a failure here only means no tuning
  };
  if (cudaMalloc(&out, y_bytes) != cudaSuccess ||
      cudaMalloc(&flush, kFlushBytes) != cudaSuccess || cudaEventCreate(&start) != cudaSuccess ||
      cudaEventCreate(&stop) != cudaSuccess) {
    release();
    return best;
  }
  // The product's C: y's current values when accumulating (y itself is never written here).
  auto init = [&](float* c) {
    return accumulate ? cudaMemcpyAsync(c, y, y_bytes, cudaMemcpyDeviceToDevice, stream_)
                      : cudaSuccess;
  };
  // Mean milliseconds of kTimedRuns cold-L2 runs into `out`, or -1 when the candidate fails.
  auto time = [&](auto run) -> float {
    if (init(out) != cudaSuccess || run(out) != CUBLAS_STATUS_SUCCESS) return -1;
    float total = 0;
    for (int r = 0; r < kTimedRuns; ++r) {
      float ms = 0;
      if (cudaMemsetAsync(flush, r, kFlushBytes, stream_) != cudaSuccess ||
          init(out) != cudaSuccess || cudaEventRecord(start, stream_) != cudaSuccess ||
          run(out) != CUBLAS_STATUS_SUCCESS || cudaEventRecord(stop, stream_) != cudaSuccess ||
          cudaEventSynchronize(stop) != cudaSuccess ||
          cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
        return -1;
      }
      total += ms;
    }
    return total / kTimedRuns;
  };
  std::vector<float> want(m * n), got(m * n);
  auto to_host = [&](const float* d, std::vector<float>* h) {
    return cudaMemcpyAsync(h->data(), d, y_bytes, cudaMemcpyDeviceToHost, stream_) ==
               cudaSuccess &&
           cudaStreamSynchronize(stream_) == cudaSuccess;
  };
  const float default_ms =
      time([&](float* c) { return RunDefault(x, w, c, s); });
  if (default_ms < 0 || !to_host(out, &want)) {
    release();
    return best;
  }
  double scale = 1e-30;
  for (float v : want) scale = std::max(scale, std::abs(double(v)));

  Plan lt;
  lt.kind = Kind::kLt;
  cublasLtMatmulHeuristicResult_t results[kTuneCandidates] = {};
  int returned = 0;
  const bool ok = LtCandidates(s, &lt, results, &returned);
  float best_ms = default_ms;
  int best_index = -1;
  for (int i = 0; ok && i < returned; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    lt.algo = results[i].algo;
    const float ms = time([&](float* c) { return RunPlan(lt, x, w, c, s); });
    if (ms < 0 || !to_host(out, &got)) {
      cudaGetLastError();
      continue;
    }
    if (!(MaxDifference(got, want) / scale <= kCandidateTolerance)) continue;  // NaN fails too
    if (ms < best_ms) {
      best_ms = ms;
      best_index = i;
    }
  }
  // Our GEMV kernel, for the smallest batches.
  float gemv_ms = -1;
  if (m <= kMaxGemvRows && k % 8 == 0) {
    Plan gemv;
    gemv.kind = Kind::kGemv;
    const float ms = time([&](float* c) { return RunPlan(gemv, x, w, c, s); });
    if (ms >= 0 && to_host(out, &got) &&
        MaxDifference(got, want) / scale <= kCandidateTolerance) {
      gemv_ms = ms;
    }
    cudaGetLastError();
  }
  release();
  if (gemv_ms >= 0 && gemv_ms < best_ms) {
    Destroy(&lt);
    Plan gemv;
    gemv.kind = Kind::kGemv;
    gemv.what = absl::StrFormat("GEMV kernel %.1f us (default %.1f us, best cuBLASLt %s)",
                                1e3 * gemv_ms, 1e3 * default_ms,
                                best_index < 0 ? "slower than the default"
                                               : absl::StrFormat("%.1f us", 1e3 * best_ms));
    return gemv;
  }
  if (best_index < 0) {
    Destroy(&lt);
    best.what = absl::StrFormat("cublasGemmEx default %.1f us (%d cuBLASLt candidates slower)",
                                1e3 * default_ms, returned);
    return best;
  }
  lt.algo = results[best_index].algo;
  lt.what = absl::StrFormat("cuBLASLt heuristic #%d %.1f us (default %.1f us)", best_index,
                            1e3 * best_ms, 1e3 * default_ms);
  return lt;
}

std::vector<std::string> Gemm::Choices() const {
  std::vector<std::string> lines;
  for (const auto& [shape, plan] : plans_) {
    const auto [m, n, k, accumulate] = shape;
    lines.push_back(absl::StrCat(m, " ", n, " ", k, accumulate ? " acc" : "", ": ", plan.what));
  }
  return lines;
}

absl::Status Gemm::MatMulBf16(const bf16* x, const bf16* w, float* y, int64_t m, int64_t n,
                              int64_t k, bool accumulate) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (m <= 0 || n <= 0 || k <= 0 || m > kMax || n > kMax || k > kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMM sizes out of range: m=", m, " n=", n, " k=", k));
  }
  const Shape shape{m, n, k, accumulate};
  auto it = plans_.find(shape);
  if (it == plans_.end()) {
    // Never tune while the stream is recorded into a graph (tuning synchronises and allocates):
    // run the default uncached, so the first eager product of the shape still tunes.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const bool capturing = cudaStreamIsCapturing(stream_, &capture) != cudaSuccess ||
                           capture != cudaStreamCaptureStatusNone;
    if (!tune_ || capturing || !Aligned(x, w, y)) {
      if (cublasStatus_t s = RunDefault(x, w, y, shape); s != CUBLAS_STATUS_SUCCESS) {
        return CublasError(s, "cublasGemmEx (bf16 x bf16 -> fp32)");
      }
      return absl::OkStatus();
    }
    it = plans_.emplace(shape, Tune(x, w, y, shape)).first;
  }
  if (cublasStatus_t s = RunPlan(it->second, x, w, y, shape); s != CUBLAS_STATUS_SUCCESS) {
    const Kind kind = it->second.kind;
    return CublasError(s, kind == Kind::kLt     ? "cublasLtMatmul (bf16 x bf16 -> fp32)"
                          : kind == Kind::kGemv ? "GEMV kernel (bf16 x bf16 -> fp32)"
                                                : "cublasGemmEx (bf16 x bf16 -> fp32)");
  }
  return absl::OkStatus();
}

}  // namespace fluxion::kernels::cuda
