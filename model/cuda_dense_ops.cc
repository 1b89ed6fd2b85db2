#include "model/cuda_dense_ops.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/decode_ops.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"

namespace fluxion::model {
namespace {

namespace kc = ::fluxion::kernels::cuda;

// Weights are staged through a device buffer of at most this many floats (64 MiB) and cast to
// bf16 there: the host side stays a plain copy of the model's fp32 vectors, and the largest
// matrix (a 128K-vocabulary LM head, 2 GiB in fp32) needs no fp32 device copy.
constexpr int64_t kStagingFloats = int64_t{16} << 20;

// CopyFromHost stages copies of at most kSmallCopyBytes through kPinnedBytes of pinned memory.
constexpr size_t kSmallCopyBytes = size_t{64} << 10;
constexpr size_t kPinnedBytes = size_t{1} << 20;

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ")"));
}

class DeviceBuffer : public OpsBuffer {
 public:
  DeviceBuffer(void* data, size_t size) : data_(data), size_(size) {}
  ~DeviceBuffer() override { cudaFree(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  void* data_;
  size_t size_;
};

class CudaGraph : public OpsGraph {
 public:
  explicit CudaGraph(cudaGraphExec_t exec) : exec_(exec) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec_); }
  cudaGraphExec_t exec() const { return exec_; }

 private:
  cudaGraphExec_t exec_;
};

// The dense seam, its fused operations (GEMM input = bf16), graph capture and the sampler's
// candidates, on one stream.
class CudaDenseOps : public DenseOps, public FusedDenseOps, public OpsGraphs, public CandidateOps {
 public:
  // `pinned` (kPinnedBytes of page-locked host memory, or null: every copy then waits) is owned.
  CudaDenseOps(int device, cudaStream_t stream, std::unique_ptr<kc::Gemm> gemm, void* pinned)
      : device_(device), stream_(stream), gemm_(std::move(gemm)), pinned_(pinned) {}
  ~CudaDenseOps() override {
    cudaStreamSynchronize(stream_);
    if (pinned_ != nullptr) cudaFreeHost(pinned_);
    gemm_.reset();  // its handle is bound to the stream
    x_bf16_.reset();
    scratch_.reset();
    candidates_.reset();
    staging_.reset();
    cudaStreamDestroy(stream_);
  }

  absl::string_view name() const override { return "cuda"; }
  bool host_memory() const override { return false; }
  // Device pointers are valid on every stream of the device's context: another CudaDenseOps on
  // the same device reads this one's weights (each on its own stream, with its own scratch).
  bool CanUseWeightsOf(const DenseOps& owner) const override {
    const auto* cuda = dynamic_cast<const CudaDenseOps*>(&owner);
    return cuda != nullptr && cuda->device_ == device_;
  }

  absl::StatusOr<std::unique_ptr<OpsBuffer>> Allocate(size_t bytes) override {
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1)); e != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky: clear it
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", bytes, " bytes on CUDA device ", device_, ": ",
          cudaGetErrorString(e)));
    }
    return std::make_unique<DeviceBuffer>(p, bytes);
  }

  void CopyFromHost(void* dst, const void* host_src, size_t bytes) override {
    if (bytes == 0) return;
    if (capturing_) {
      // A graph would record the staging slot, not the caller's data: not recordable.
      RecordStatus(absl::FailedPreconditionError(
          "CudaDenseOps::CopyFromHost cannot be recorded into a graph"));
      return;
    }
    if (bytes <= kSmallCopyBytes && pinned_ != nullptr) {
      // Small copies (a step's tokens and positions, a layer's attention rows) go through pinned
      // staging, so the caller's source is free at once and the stream need not be waited for.
      // A slot is reused only after a synchronisation, when every copy from it has run.
      if (pinned_used_ + bytes > kPinnedBytes) {
        Record(cudaStreamSynchronize(stream_), "CopyFromHost (staging wait)");
        pinned_used_ = 0;
      }
      char* slot = static_cast<char*>(pinned_) + pinned_used_;
      std::memcpy(slot, host_src, bytes);
      pinned_used_ += (bytes + 255) / 256 * 256;
      Record(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, stream_), "CopyFromHost");
      return;
    }
    Record(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_),
           "CopyFromHost");
    Record(cudaStreamSynchronize(stream_), "CopyFromHost (wait)");  // the source may be reused
    pinned_used_ = 0;  // the stream is drained: every staged copy has run
  }

  void CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    Record(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "CopyToHost");
    Record(cudaStreamSynchronize(stream_), "CopyToHost (wait)");
    pinned_used_ = 0;
  }

  void Copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
    if (d < s + bytes && s < d + bytes) {
      // cudaMemcpy does not promise memmove's semantics for overlapping ranges: go through
      // scratch (grown once; ForwardBatch-style compaction moves rows down over their old place).
      if (absl::Status g = Grow(&scratch_, bytes, "Copy scratch"); !g.ok()) {
        RecordStatus(std::move(g));
        return;
      }
      Record(cudaMemcpyAsync(scratch_->data(), src, bytes, cudaMemcpyDeviceToDevice, stream_),
             "Copy");
      src = scratch_->data();
    }
    Record(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "Copy");
  }

  absl::StatusOr<UploadedWeight> UploadWeight(const float* host, int64_t rows,
                                              int64_t cols) override {
    const int64_t n = rows * cols;
    UploadedWeight w;
    FLUXION_ASSIGN_OR_RETURN(w.owner, Allocate(static_cast<size_t>(n) * sizeof(bf16)));
    FLUXION_RETURN_IF_ERROR(
        Grow(&staging_, std::min(n, kStagingFloats) * sizeof(float), "UploadWeight staging"));
    bf16* out = static_cast<bf16*>(w.owner->data());
    float* staging = static_cast<float*>(staging_->data());
    for (int64_t i = 0; i < n; i += kStagingFloats) {
      const int64_t len = std::min(kStagingFloats, n - i);
      // From pageable memory the copy returns once the host data is staged, so the loop reuses
      // `staging` only after the previous cast (same stream) has read it.
      Record(cudaMemcpyAsync(staging, host + i, len * sizeof(float), cudaMemcpyHostToDevice,
                             stream_),
             "UploadWeight copy");
      Record(kc::CastToBf16(staging, out + i, len, stream_), "UploadWeight cast");
    }
    FLUXION_RETURN_IF_ERROR(Sync());
    w.ref = WeightRef{out, WeightDType::kBF16};
    return w;
  }

  void MatMul(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n,
              int64_t k, bool accumulate) override {
    if (m == 0) return;
    if (w.dtype != WeightDType::kBF16) {
      RecordStatus(absl::InternalError(
          "CudaDenseOps::MatMul got a weight it did not upload (not bf16): use "
          "Model::UploadParams on this DenseOps"));
      return;
    }
    if (absl::Status g = Grow(&x_bf16_, static_cast<size_t>(m * k) * sizeof(bf16), "MatMul input");
        !g.ok()) {
      RecordStatus(std::move(g));
      return;
    }
    bf16* xb = static_cast<bf16*>(x_bf16_->data());
    Record(kc::CastToBf16(x, xb, m * k, stream_), "MatMul cast");
    Product(xb, w, bias, y, m, n, k, accumulate);
  }

  void RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m,
               int64_t d) override {
    Record(kc::RmsNorm(x, weight, eps, y, m, d, stream_), "RmsNorm");
  }

  void ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
                 int64_t heads, int64_t head_dim) override {
    Record(kc::ApplyRope(x, positions, inv_freq, n, heads, head_dim, stream_), "ApplyRope");
  }

  void SiluMul(const float* gate, const float* up, float* out, int64_t n) override {
    Record(kc::SiluMul(gate, up, out, n, stream_), "SiluMul");
  }

  void GatherRows(WeightRef table, const int32_t* ids, int64_t n, int64_t width,
                  float* out) override {
    if (table.dtype != WeightDType::kBF16) {
      RecordStatus(absl::InternalError(
          "CudaDenseOps::GatherRows got a table it did not upload (not bf16)"));
      return;
    }
    Record(kc::EmbedRows(static_cast<const bf16*>(table.data), ids, out, n, width, stream_),
           "GatherRows");
  }

  absl::Status Sync() override {
    Record(cudaStreamSynchronize(stream_), "Sync");
    pinned_used_ = 0;
    absl::Status s = std::move(status_);
    status_ = absl::OkStatus();
    return s;
  }

  void* native_stream() const override { return stream_; }
  FusedDenseOps* fused() override { return this; }
  OpsGraphs* graphs() override { return this; }
  CandidateOps* candidates() override { return this; }

  // CandidateOps: the kernel over the logits where they are; only its results cross (8 bytes per
  // candidate and 16 per row), into the caller's host arrays.
  void TopCandidates(const float* logits, int64_t rows, int64_t vocab, int64_t k,
                     const double* temperatures, int32_t* ids, float* values,
                     double* normalisers) override {
    const int64_t n = std::min(k, vocab);
    // Scratch: temperatures and normalisers [rows] (double), then ids and values [rows][n].
    const size_t row_bytes = static_cast<size_t>(rows) * sizeof(double);
    const size_t list_bytes = static_cast<size_t>(rows * n) * sizeof(int32_t);
    if (absl::Status g = Grow(&candidates_, 2 * row_bytes + 2 * list_bytes, "TopCandidates",
                              /*recordable=*/false);
        !g.ok()) {
      RecordStatus(std::move(g));
      return;
    }
    char* base = static_cast<char*>(candidates_->data());
    double* d_temperatures = reinterpret_cast<double*>(base);
    double* d_normalisers = d_temperatures + rows;
    int32_t* d_ids = reinterpret_cast<int32_t*>(base + 2 * row_bytes);
    float* d_values = reinterpret_cast<float*>(base + 2 * row_bytes + list_bytes);
    CopyFromHost(d_temperatures, temperatures, row_bytes);
    Record(kc::TopCandidates(logits, rows, vocab, k, d_temperatures, d_ids, d_values,
                             d_normalisers, stream_),
           "TopCandidates");
    Record(cudaMemcpyAsync(ids, d_ids, list_bytes, cudaMemcpyDeviceToHost, stream_),
           "TopCandidates (ids)");
    Record(cudaMemcpyAsync(values, d_values, list_bytes, cudaMemcpyDeviceToHost, stream_),
           "TopCandidates (values)");
    Record(cudaMemcpyAsync(normalisers, d_normalisers, row_bytes, cudaMemcpyDeviceToHost,
                           stream_),
           "TopCandidates (normalisers)");
    Record(cudaStreamSynchronize(stream_), "TopCandidates (wait)");
    pinned_used_ = 0;
  }

  // FusedDenseOps: activations go to the products as bf16, written by the operation before.
  size_t GemmInputBytes(int64_t n) const override { return static_cast<size_t>(n) * sizeof(bf16); }

  void RmsNormToGemmInput(const float* x, const float* weight, float eps, void* xg, int64_t m,
                          int64_t d) override {
    Record(kc::RmsNormBf16(x, weight, eps, static_cast<bf16*>(xg), m, d, stream_),
           "RmsNormToGemmInput");
  }

  void ToGemmInput(const float* x, void* xg, int64_t n) override {
    Record(kc::CastToBf16(x, static_cast<bf16*>(xg), n, stream_), "ToGemmInput");
  }

  void MatMulGemmInput(const void* xg, WeightRef w, const float* bias, float* y, int64_t m,
                       int64_t n, int64_t k, bool accumulate) override {
    if (m == 0) return;
    if (w.dtype != WeightDType::kBF16) {
      RecordStatus(absl::InternalError(
          "CudaDenseOps::MatMulGemmInput got a weight it did not upload (not bf16)"));
      return;
    }
    Product(static_cast<const bf16*>(xg), w, bias, y, m, n, k, accumulate);
  }

  void SplitQkvRope(const float* qkv, const float* bias, const int64_t* positions,
                    const float* inv_freq, float* q, float* k, float* v, int64_t m, int64_t heads,
                    int64_t kv_heads, int64_t head_dim) override {
    Record(kc::SplitQkvRope(qkv, bias, positions, inv_freq, q, k, v, m, heads, kv_heads, head_dim,
                            stream_),
           "SplitQkvRope");
  }

  void SiluMulToGemmInput(const float* gate_up, void* outg, int64_t m, int64_t f) override {
    Record(kc::SiluMulRowsBf16(gate_up, static_cast<bf16*>(outg), m, f, stream_),
           "SiluMulToGemmInput");
  }

  // OpsGraphs. Thread-local capture mode: only this thread's unsafe calls (a synchronisation, an
  // allocation) break the capture, not another thread's CUDA work (the hybrid step's).
  absl::Status BeginCapture() override {
    if (capturing_) return absl::FailedPreconditionError("CudaDenseOps: already capturing");
    if (cudaError_t e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
        e != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(e, "CudaDenseOps::BeginCapture");
    }
    capturing_ = true;
    capture_status_ = absl::OkStatus();
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<OpsGraph>> EndCapture() override {
    if (!capturing_) return absl::FailedPreconditionError("CudaDenseOps: not capturing");
    capturing_ = false;
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    absl::Status s = std::move(capture_status_);
    capture_status_ = absl::OkStatus();
    if (end != cudaSuccess) {
      cudaGetLastError();  // an invalidated capture is not sticky
      if (s.ok()) s = CudaStatus(end, "CudaDenseOps::EndCapture");
    }
    if (!s.ok()) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      return s;
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (inst != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(inst, "CudaDenseOps::EndCapture (instantiate)");
    }
    return std::unique_ptr<OpsGraph>(new CudaGraph(exec));
  }

  void Replay(OpsGraph& graph) override {
    Record(cudaGraphLaunch(static_cast<CudaGraph&>(graph).exec(), stream_), "Replay");
  }

  uint64_t generation() const override { return generation_; }

 private:
  // y = xb . w^T (+ y) (+ bias) with xb already bf16.
  void Product(const bf16* xb, WeightRef w, const float* bias, float* y, int64_t m, int64_t n,
               int64_t k, bool accumulate) {
    if (absl::Status s = gemm_->MatMulBf16(xb, static_cast<const bf16*>(w.data), y, m, n, k,
                                           accumulate);
        !s.ok()) {
      RecordStatus(absl::Status(s.code(), absl::StrCat("CudaDenseOps::MatMul (m=", m, " n=", n,
                                                       " k=", k, "): ", s.message())));
      return;
    }
    if (bias != nullptr) Record(kc::AddBiasRows(y, bias, m, n, stream_), "MatMul bias");
  }

  void Record(cudaError_t e, absl::string_view what) {
    if (e != cudaSuccess) {
      RecordStatus(CudaStatus(e, absl::StrCat("CudaDenseOps::", what, " on device ", device_)));
    }
  }
  // While capturing, errors belong to the capture (EndCapture returns them), not to Sync.
  void RecordStatus(absl::Status s) {
    absl::Status& first = capturing_ ? capture_status_ : status_;
    if (first.ok()) first = std::move(s);
  }
  // Makes *buf hold at least `bytes` (ResourceExhausted when it cannot). Grows only: after a
  // step at a batch size, later steps at that size allocate nothing. A buffer no graph can record
  // (`recordable` false: the candidates' scratch) leaves the graphs valid.
  absl::Status Grow(std::unique_ptr<OpsBuffer>* buf, size_t bytes, absl::string_view what,
                    bool recordable = true) {
    if (*buf != nullptr && (*buf)->size() >= bytes) return absl::OkStatus();
    if (capturing_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CudaDenseOps ", what, ": scratch would have to grow while recording a graph"));
    }
    if (recordable) ++generation_;  // graphs recorded over the old buffer must not replay
    // No queued operation may still use the old buffer when it is freed.
    if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
      return CudaStatus(e, absl::StrCat("CudaDenseOps ", what));
    }
    buf->reset();
    absl::StatusOr<std::unique_ptr<OpsBuffer>> b = Allocate(bytes);
    if (!b.ok()) {
      return absl::Status(b.status().code(),
                          absl::StrCat("CudaDenseOps ", what, ": ", b.status().message()));
    }
    *buf = std::move(*b);
    return absl::OkStatus();
  }

  const int device_;
  cudaStream_t stream_;
  std::unique_ptr<kc::Gemm> gemm_;
  std::unique_ptr<OpsBuffer> x_bf16_;   // MatMul's input cast to bf16 [m][k]
  std::unique_ptr<OpsBuffer> scratch_;  // Copy between overlapping ranges
  std::unique_ptr<OpsBuffer> staging_;  // UploadWeight's fp32 chunks
  std::unique_ptr<OpsBuffer> candidates_;  // TopCandidates's inputs and results
  absl::Status status_;                 // the first error since the last Sync
  bool capturing_ = false;
  absl::Status capture_status_;         // the first error since BeginCapture
  uint64_t generation_ = 0;             // bumped when scratch is reallocated
  void* pinned_;                        // staging of small CopyFromHost calls
  size_t pinned_used_ = 0;              // bytes of it that queued copies may still read
};

}  // namespace

absl::StatusOr<std::unique_ptr<DenseOps>> NewCudaDenseOps(int device) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device is available (cudaGetDeviceCount: ",
        e != cudaSuccess ? cudaGetErrorString(e) : "0 devices",
        "): run with --device cpu, or on a machine with an NVIDIA GPU and its driver"));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " does not exist: this machine has ", count));
  }
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return CudaStatus(e, absl::StrCat("cudaSetDevice(", device, ")"));
  }
  // The highest stream priority: when other work shares the device (the hybrid step's zero-copy
  // reads of host pages, at the lowest: decode/device/cuda_resident_window.cc), the dense kernels'
  // blocks are scheduled first, since the next CPU phase waits for them.
  int least_priority = 0, greatest_priority = 0;
  if (cudaError_t e = cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority);
      e != cudaSuccess) {
    return CudaStatus(e, "cudaDeviceGetStreamPriorityRange");
  }
  cudaStream_t stream = nullptr;
  if (cudaError_t e =
          cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest_priority);
      e != cudaSuccess) {
    return CudaStatus(e, "cudaStreamCreate");
  }
  absl::StatusOr<std::unique_ptr<kc::Gemm>> gemm = kc::Gemm::Create(stream);
  if (!gemm.ok()) {
    cudaStreamDestroy(stream);
    return gemm.status();
  }
  // Without pinned staging (cudaMallocHost refused) small copies wait, as large ones do.
  void* pinned = nullptr;
  if (cudaMallocHost(&pinned, kPinnedBytes) != cudaSuccess) {
    cudaGetLastError();
    pinned = nullptr;
  }
  return std::unique_ptr<DenseOps>(
      new CudaDenseOps(device, stream, std::move(*gemm), pinned));
}

}  // namespace fluxion::model
