// The dense seam of a layer (docs/EXECUTOR.md): the few operations a transformer layer's dense
// work is made of (matrix products, RMSNorm, RoPE, SwiGLU, row gather and copies), and the memory
// they run on. model/layer.h composes them into the pre-attention and post-attention halves of a
// layer once, for every backend; a backend only implements the operations. The CPU backend
// (cpu_dense_ops.h) runs them with OpenBLAS and the AVX2 kernels on host memory; a CUDA backend
// (cuBLAS and a handful of elementwise kernels on a stream) implements the same interface on
// device memory, ggml's backend split kept small.
//
// Memory: every pointer an operation takes is in the backend's memory (Allocate), which the host
// may dereference only when host_memory() is true. Host data crosses only through CopyFromHost /
// CopyToHost. Weights therefore live in the backend's memory too (Model::UploadParams), and the
// weight matrices (the projections, the embedding table, the LM head) in a format the backend
// chooses: UploadWeight turns the model's fp32 host matrix into a WeightRef (the CPU backend
// borrows the host matrix; the CUDA backend keeps bf16 in HBM, half the bytes a step reads).
// Norm gains, biases and RoPE frequencies stay fp32 and cross through Allocate + CopyFromHost.
//
// Ordering and errors: operations may run asynchronously but in the order they were issued (one
// CUDA stream); a CopyToHost returns once its data is on the host, a CopyFromHost once its source
// may be reused. Operations return nothing: a device failure is recorded and Sync() returns the
// first since the last Sync (Internal, with context), as CUDA's sticky errors work. The CPU
// backend never fails.
//
// Thread-compatible: one driver thread per DenseOps.
#ifndef FLUXION_MODEL_DENSE_OPS_H_
#define FLUXION_MODEL_DENSE_OPS_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fluxion::model {

// A block of a DenseOps's memory, freed on destruction (which must not outlive its DenseOps).
class OpsBuffer {
 public:
  virtual ~OpsBuffer() = default;
  // Backend memory: see the header comment before dereferencing.
  virtual void* data() = 0;
  virtual size_t size() const = 0;
};

// The storage format of a weight matrix, chosen by the backend that uploaded it.
enum class WeightDType { kF32, kBF16 };

// A weight matrix [rows][cols], row-major, in a DenseOps's memory and format. Only the DenseOps
// whose UploadWeight made it may use it.
struct WeightRef {
  const void* data = nullptr;
  WeightDType dtype = WeightDType::kF32;
};

// UploadWeight's result: the handle, and the buffer it points into (null when the backend borrows
// the host matrix, which must then outlive the handle).
struct UploadedWeight {
  WeightRef ref;
  std::unique_ptr<OpsBuffer> owner;
};

class DenseOps {
 public:
  virtual ~DenseOps() = default;
  virtual absl::string_view name() const = 0;
  // True when the memory the operations use is host memory.
  virtual bool host_memory() const = 0;

  // Memory. Allocate: ResourceExhausted when it cannot. Contents start unspecified.
  virtual absl::StatusOr<std::unique_ptr<OpsBuffer>> Allocate(size_t bytes) = 0;
  virtual void CopyFromHost(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;
  // Within backend memory; the ranges may overlap (memmove).
  virtual void Copy(void* dst, const void* src, size_t bytes) = 0;
  // The weight matrix host[rows][cols] (fp32, host memory) in this backend's memory and format.
  // ResourceExhausted when it cannot allocate; may be asynchronous (the host matrix must stay
  // valid and unchanged until the next Sync).
  virtual absl::StatusOr<UploadedWeight> UploadWeight(const float* host, int64_t rows,
                                                      int64_t cols) = 0;

  // Math, with the contracts (and shapes) of kernels/reference/reference_ops.h:
  // y[m][n] = x[m][k] . w[n][k]^T + bias[n] (+ y when accumulate); bias may be null. A backend
  // whose weights are narrower than fp32 rounds x to the weights' type for the product and
  // accumulates in fp32.
  virtual void MatMul(const float* x, WeightRef w, const float* bias, float* y, int64_t m,
                      int64_t n, int64_t k, bool accumulate) = 0;
  // y[m][d] = x / sqrt(mean(x^2) + eps) * weight[d]; y may alias x.
  virtual void RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m,
                       int64_t d) = 0;
  // Rotate-half RoPE in place on x[n][heads][head_dim], row t at positions[t].
  virtual void ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
                         int64_t heads, int64_t head_dim) = 0;
  // out[n] = silu(gate[n]) * up[n]; out may alias gate or up.
  virtual void SiluMul(const float* gate, const float* up, float* out, int64_t n) = 0;
  // out[i][:] = float(table[ids[i]][:]) for i < n, rows of `width` (the embedding lookup).
  // REQUIRES: every id is a valid row (the caller checked the token ids).
  virtual void GatherRows(WeightRef table, const int32_t* ids, int64_t n, int64_t width,
                          float* out) = 0;

  // Waits for every issued operation; the first error since the last Sync, or OK.
  virtual absl::Status Sync() = 0;

  // The backend's native queue (a cudaStream_t for CUDA), for work that must run in order with
  // the operations (the hybrid step's resident window, decode/cuda_resident_window.h); null for
  // backends that run synchronously on the host.
  virtual void* native_stream() const { return nullptr; }
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_DENSE_OPS_H_
