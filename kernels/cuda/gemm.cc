#include "kernels/cuda/gemm.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace fluxion::kernels::cuda {
namespace {

absl::Status CublasError(cublasStatus_t s, const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", cublasGetStatusName(s), " (",
                                          cublasGetStatusString(s), ")"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Gemm>> Gemm::Create(cudaStream_t stream, size_t workspace_bytes) {
  cublasHandle_t handle = nullptr;
  if (cublasStatus_t s = cublasCreate(&handle); s != CUBLAS_STATUS_SUCCESS) {
    return CublasError(s, "cublasCreate");
  }
  void* workspace = nullptr;
  if (cudaError_t e = cudaMalloc(&workspace, workspace_bytes); e != cudaSuccess) {
    cublasDestroy(handle);
    return absl::InternalError(
        absl::StrCat("cudaMalloc of the cuBLAS workspace: ", cudaGetErrorString(e)));
  }
  std::unique_ptr<Gemm> gemm(new Gemm(handle, workspace));
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
  cublasDestroy(handle_);
  cudaFree(workspace_);
}

absl::Status Gemm::MatMulBf16(const bf16* x, const bf16* w, float* y, int64_t m, int64_t n,
                              int64_t k, bool accumulate) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (m <= 0 || n <= 0 || k <= 0 || m > kMax || n > kMax || k > kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMM sizes out of range: m=", m, " n=", n, " k=", k));
  }
  // Row-major y[m][n] is column-major y^T[n][m] = w[n][k] . x^T, where row-major w[n][k] is the
  // column-major k x n matrix (transposed in the product) and row-major x[m][k] the column-major
  // k x m matrix.
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  cublasStatus_t s = cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                  static_cast<int>(m), static_cast<int>(k), &alpha, w,
                                  CUDA_R_16BF, static_cast<int>(k), x, CUDA_R_16BF,
                                  static_cast<int>(k), &beta, y, CUDA_R_32F, static_cast<int>(n),
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) return CublasError(s, "cublasGemmEx (bf16 x bf16 -> fp32)");
  return absl::OkStatus();
}

}  // namespace fluxion::kernels::cuda
