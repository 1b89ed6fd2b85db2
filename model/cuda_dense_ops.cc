#include "model/cuda_dense_ops.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/decode_ops.h"
#include "kernels/cuda/gemm.h"

namespace fluxion::model {
namespace {

namespace kc = ::fluxion::kernels::cuda;

// Weights are staged through a device buffer of at most this many floats (64 MiB) and cast to
// bf16 there: the host side stays a plain copy of the model's fp32 vectors, and the largest
// matrix (a 128K-vocabulary LM head, 2 GiB in fp32) needs no fp32 device copy.
constexpr int64_t kStagingFloats = int64_t{16} << 20;

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

class CudaDenseOps : public DenseOps {
 public:
  CudaDenseOps(int device, cudaStream_t stream, std::unique_ptr<kc::Gemm> gemm)
      : device_(device), stream_(stream), gemm_(std::move(gemm)) {}
  ~CudaDenseOps() override {
    cudaStreamSynchronize(stream_);
    gemm_.reset();  // its handle is bound to the stream
    x_bf16_.reset();
    scratch_.reset();
    staging_.reset();
    cudaStreamDestroy(stream_);
  }

  absl::string_view name() const override { return "cuda"; }
  bool host_memory() const override { return false; }

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
    Record(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_),
           "CopyFromHost");
    Record(cudaStreamSynchronize(stream_), "CopyFromHost (wait)");  // the source may be reused
  }

  void CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    Record(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "CopyToHost");
    Record(cudaStreamSynchronize(stream_), "CopyToHost (wait)");
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
    if (absl::Status s = gemm_->MatMulBf16(xb, static_cast<const bf16*>(w.data), y, m, n, k,
                                           accumulate);
        !s.ok()) {
      RecordStatus(absl::Status(s.code(), absl::StrCat("CudaDenseOps::MatMul (m=", m, " n=", n,
                                                       " k=", k, "): ", s.message())));
      return;
    }
    if (bias != nullptr) Record(kc::AddBiasRows(y, bias, m, n, stream_), "MatMul bias");
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
    absl::Status s = std::move(status_);
    status_ = absl::OkStatus();
    return s;
  }

  void* native_stream() const override { return stream_; }

 private:
  void Record(cudaError_t e, absl::string_view what) {
    if (e != cudaSuccess) {
      RecordStatus(CudaStatus(e, absl::StrCat("CudaDenseOps::", what, " on device ", device_)));
    }
  }
  void RecordStatus(absl::Status s) {
    if (status_.ok()) status_ = std::move(s);
  }
  // Makes *buf hold at least `bytes` (ResourceExhausted when it cannot). Grows only: after a
  // step at a batch size, later steps at that size allocate nothing.
  absl::Status Grow(std::unique_ptr<OpsBuffer>* buf, size_t bytes, absl::string_view what) {
    if (*buf != nullptr && (*buf)->size() >= bytes) return absl::OkStatus();
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
  absl::Status status_;                 // the first error since the last Sync
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
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return CudaStatus(e, "cudaStreamCreate");
  }
  absl::StatusOr<std::unique_ptr<kc::Gemm>> gemm = kc::Gemm::Create(stream);
  if (!gemm.ok()) {
    cudaStreamDestroy(stream);
    return gemm.status();
  }
  return std::unique_ptr<DenseOps>(new CudaDenseOps(device, stream, std::move(*gemm)));
}

}  // namespace fluxion::model
