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
// Optional capabilities (FusedDenseOps, OpsGraphs, CandidateOps below): a backend offers them
// through fused() / graphs() / candidates(); the layer body (layer.h), the step runner
// (decode_step.h) and the hybrid executor's sampling use them when offered, so a backend without
// them (the CPU's has no fused ops or graphs) runs its plain operations unchanged.
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

class FusedDenseOps;
class OpsGraphs;
class CandidateOps;

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

  // Weight sharing: whether this DenseOps may run over ModelParams whose weights `owner` uploaded
  // (BorrowParams in layer.h), so that two DenseOps (two streams, two sets of scratch: the
  // ping-pong executor's micro-batches) read one copy of the weights. True for two CPU DenseOps
  // on host memory and for two CUDA DenseOps on the same device; by default only for itself.
  // The rule that comes with it: the owner (and the ModelParams that own the buffers) must
  // outlive every DenseOps that borrows them, and its uploads must be complete (owner.Sync())
  // before another DenseOps reads them; a borrower never writes them (FuseParams runs on the
  // owner, before the params are borrowed).
  virtual bool CanUseWeightsOf(const DenseOps& owner) const { return &owner == this; }

  // The backend's native queue (a cudaStream_t for CUDA), for work that must run in order with
  // the operations (the hybrid step's resident window, decode/device/cuda_resident_window.h); null
  // for backends that run synchronously on the host.
  virtual void* native_stream() const { return nullptr; }

  // The optional capabilities, or null when the backend has none (the default).
  virtual FusedDenseOps* fused() { return nullptr; }
  virtual OpsGraphs* graphs() { return nullptr; }
  virtual CandidateOps* candidates() { return nullptr; }
};

// Fused forms of the layer's operations, for a backend where each launch and each pass over the
// activations costs (CUDA): one product for q/k/v and one for gate/up over stacked weights
// (FuseParams in layer.h stacks them), their epilogues (bias split, RoPE, SiLU * up) in one
// operation each, and activations handed to the products already in the format the products read
// ("GEMM input": bf16 on CUDA), so no separate cast runs before each product.
//
// GEMM-input memory is backend memory of GemmInputBytes(n) bytes for n values, written and read
// only by the operations below. Ordering and errors as DenseOps's (same queue, sticky errors).
class FusedDenseOps {
 public:
  virtual ~FusedDenseOps() = default;
  virtual size_t GemmInputBytes(int64_t n) const = 0;
  // xg[m][d] = RMSNorm(x)[m][d] (DenseOps::RmsNorm's math) in GEMM-input format.
  virtual void RmsNormToGemmInput(const float* x, const float* weight, float eps, void* xg,
                                  int64_t m, int64_t d) = 0;
  // xg[n] = x[n] in GEMM-input format.
  virtual void ToGemmInput(const float* x, void* xg, int64_t n) = 0;
  // DenseOps::MatMul's contract with the input already in GEMM-input format.
  virtual void MatMulGemmInput(const void* xg, WeightRef w, const float* bias, float* y, int64_t m,
                               int64_t n, int64_t k, bool accumulate) = 0;
  // Row t of qkv [m][(heads + 2 kv_heads) * head_dim] (plus bias, [(heads + 2 kv_heads) *
  // head_dim] or null) splits into q [m][heads][head_dim], k and v [m][kv_heads][head_dim], with
  // ApplyRope's rotation on q and k at positions[t]. Outputs do not alias qkv.
  virtual void SplitQkvRope(const float* qkv, const float* bias, const int64_t* positions,
                            const float* inv_freq, float* q, float* k, float* v, int64_t m,
                            int64_t heads, int64_t kv_heads, int64_t head_dim) = 0;
  // outg[t][j] = silu(gate_up[t][j]) * gate_up[t][f + j] for t < m, j < f (gate rows then up
  // rows of the stacked product), in GEMM-input format.
  virtual void SiluMulToGemmInput(const float* gate_up, void* outg, int64_t m, int64_t f) = 0;
};

// A recorded run of operations (a CUDA graph), replayed as one launch.
class OpsGraph {
 public:
  virtual ~OpsGraph() = default;
};

// Recording the operations issued between BeginCapture and EndCapture into an OpsGraph instead of
// running them; Replay runs a graph as recorded: the same operations on the same pointers and
// sizes, reading the memory's contents at replay time. So a graph stays valid only while every
// buffer it touches stays allocated at the same address (the caller's, the weights, and the
// backend's own scratch: a capture that would have to grow scratch fails instead).
//
// EndCapture returns the graph, or the first error since BeginCapture (an operation that cannot
// be recorded, e.g. a copy that waits for the host); either way capture has ended, and on error
// nothing captured ran. Replay's errors are recorded as the operations' (DenseOps::Sync).
class OpsGraphs {
 public:
  virtual ~OpsGraphs() = default;
  virtual absl::Status BeginCapture() = 0;
  virtual absl::StatusOr<std::unique_ptr<OpsGraph>> EndCapture() = 0;
  virtual void Replay(OpsGraph& graph) = 0;
  // Changes whenever the backend reallocates memory a graph may have recorded (its scratch):
  // graphs recorded at another generation must not be replayed.
  virtual uint64_t generation() const = 0;
};

// The best tokens of each row of a logits matrix in the backend's memory, in model::Sampler's order
// (descending logit, ties by lower id), and each row's normaliser: what the sampler needs to draw
// from a row without the row (model/sampler.h SampleCandidates), so a step copies a few KB per row
// to the host instead of [vocab] floats. CUDA: kernels/cuda/sampling.h; the CPU backend computes
// the same on the host, so the host stand-in of the hybrid step runs the same path.
// Ordering and errors as DenseOps's (same queue, sticky errors).
class CandidateOps {
 public:
  // The most candidates a row may ask for.
  static constexpr int64_t kMaxCandidates = 1024;

  virtual ~CandidateOps() = default;
  // For each row r < rows of logits [rows][vocab] (backend memory), with n = min(k, vocab):
  // ids[r][0..n) and values[r][0..n) its n largest logits in the sampler's order, and
  // normalisers[r] the sum over the whole row of exp((x - max) / temperatures[r]) in double
  // (max = values[r][0]; 0 where temperatures[r] <= 0). ids, values [rows][n], temperatures and
  // normalisers [rows] are host memory. Returns once the results are on the host (as
  // CopyToHost). REQUIRES: rows >= 1, vocab >= 1, 1 <= k <= kMaxCandidates.
  virtual void TopCandidates(const float* logits, int64_t rows, int64_t vocab, int64_t k,
                             const double* temperatures, int32_t* ids, float* values,
                             double* normalisers) = 0;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_DENSE_OPS_H_
