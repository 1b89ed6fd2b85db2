// bf16 GEMMs of the decode step's dense half on cuBLAS: weights stay bf16 in HBM, activations are
// cast to bf16, products accumulate in fp32 and land in fp32. At decode batch sizes (m <= 64) these
// products are bound by reading the weights, so the weights' dtype is what sets the step time.
//
// Algorithm choice (the decode shapes, m = 1..16 rows against n x k weights of 4096 to 128256
// rows): with cublasGemmEx's default choice the small products (q/k/v, o: 16-50 MB) read their
// weights at 34-45% of HBM bandwidth at these m (H200), and which algorithm is fastest for
// such a pass over the weights is not something its heuristic promises. So with `tune` the first
// product of each (m, n, k, accumulate) -- run eagerly, never while a stream is being captured
// into a graph, and only on 256-byte aligned operands -- times cublasGemmEx's default, up to
// kTuneCandidates cuBLASLt heuristic algorithms with the whole workspace allowed (split-K
// variants among them) and, for m <= 8, our GEMV kernel (gemv.h), each on the real operands with
// L2 flushed between runs (a 32 MB weight would otherwise be timed from the 60 MB L2); checks
// each against the default's result (a candidate more than 1e-3 away, relative, is dropped); and
// keeps the fastest. The choice is fixed after that, so results are deterministic for the Gemm's
// lifetime (cuBLAS is deterministic for a given algorithm; no atomics mode is enabled). A shape
// first met while capturing, or with tuning off, runs the default.
//
// Thread-compatible: one Gemm per stream (cuBLAS handles must not be shared across threads that
// launch concurrently).
#ifndef FLUXION_KERNELS_CUDA_GEMM_H_
#define FLUXION_KERNELS_CUDA_GEMM_H_

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/half.h"

namespace fluxion::kernels::cuda {

// Owns a cuBLAS handle bound to one stream and the workspace it runs in, allocated once at
// Create(), so no GEMM on the hot path allocates device memory.
class Gemm {
 public:
  // Internal (with cuBLAS's or CUDA's message) when the handle or workspace cannot be made.
  static absl::StatusOr<std::unique_ptr<Gemm>> Create(cudaStream_t stream,
                                                      size_t workspace_bytes = 32 << 20,
                                                      bool tune = true);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y[m][n] = x[m][k] . w[n][k]^T (+ y when accumulate); x, w bf16 and y fp32, row-major, on the
  // device. InvalidArgument for a non-positive or too large (> 2^31 - 1) size; Internal when
  // cuBLAS fails.
  absl::Status MatMulBf16(const bf16* x, const bf16* w, float* y, int64_t m, int64_t n, int64_t k,
                          bool accumulate = false);

  // One line per tuned shape: "m n k acc: <choice> <us> us (default <us> us)", for benchmarks.
  std::vector<std::string> Choices() const;

  static constexpr int kTuneCandidates = 8;

 private:
  using Shape = std::tuple<int64_t, int64_t, int64_t, bool>;  // m, n, k, accumulate
  // A tuned shape's choice: cublasGemmEx's default, cuBLASLt's descriptors and algorithm, or the
  // GEMV kernel (gemv.h).
  enum class Kind { kDefault, kLt, kGemv };
  struct Plan {
    Kind kind = Kind::kDefault;
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    std::string what;
  };

  Gemm(cublasHandle_t handle, cublasLtHandle_t lt, cudaStream_t stream, void* workspace,
       size_t workspace_bytes, bool tune)
      : handle_(handle), lt_(lt), stream_(stream), workspace_(workspace),
        workspace_bytes_(workspace_bytes), tune_(tune) {}
  cublasStatus_t RunDefault(const bf16* x, const bf16* w, float* y, const Shape& s);
  cublasStatus_t RunPlan(const Plan& plan, const bf16* x, const bf16* w, float* y,
                         const Shape& s);
  // Tunes `s` on these operands (y is read when accumulating, never written): the plan to keep.
  // Any failure on the way leaves the default (lt false).
  Plan Tune(const bf16* x, const bf16* w, const float* y, const Shape& s);
  // Tune's cuBLASLt candidates for `s`: *lt's descriptors made (Destroy frees them, also on
  // failure) and up to kTuneCandidates heuristic results; false when cuBLASLt offers none.
  bool LtCandidates(const Shape& s, Plan* lt, cublasLtMatmulHeuristicResult_t* results,
                    int* returned);
  static void Destroy(Plan* plan);

  cublasHandle_t handle_;
  cublasLtHandle_t lt_;
  cudaStream_t stream_;
  void* workspace_;
  size_t workspace_bytes_;
  bool tune_;
  std::map<Shape, Plan> plans_;
};

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_GEMM_H_
