#include "model/cpu_dense_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_ops.h"

namespace fluxion::model {
namespace {

namespace cpu = ::fluxion::kernels::cpu;

class HostBuffer : public OpsBuffer {
 public:
  HostBuffer(void* data, size_t size) : data_(data), size_(size) {}
  ~HostBuffer() override { ::operator delete(data_, std::align_val_t{64}); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  void* data_;
  size_t size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<OpsBuffer>> CpuDenseOps::Allocate(size_t bytes) {
  void* p = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t{64}, std::nothrow);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  return std::make_unique<HostBuffer>(p, bytes);
}

void CpuDenseOps::CopyFromHost(void* dst, const void* host_src, size_t bytes) {
  if (bytes > 0 && dst != host_src) std::memcpy(dst, host_src, bytes);
}

void CpuDenseOps::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  if (bytes > 0 && host_dst != src) std::memcpy(host_dst, src, bytes);
}

void CpuDenseOps::Copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
}

absl::StatusOr<UploadedWeight> CpuDenseOps::UploadWeight(const float* host, int64_t rows,
                                                         int64_t cols) {
  UploadedWeight w;
  if (host_memory()) {
    w.ref.data = host;
    return w;
  }
  const size_t bytes = static_cast<size_t>(rows * cols) * sizeof(float);
  FLUXION_ASSIGN_OR_RETURN(w.owner, Allocate(bytes));
  CopyFromHost(w.owner->data(), host, bytes);
  w.ref.data = w.owner->data();
  return w;
}

void CpuDenseOps::MatMul(const float* x, WeightRef w, const float* bias, float* y, int64_t m,
                         int64_t n, int64_t k, bool accumulate) {
  UsePool();
  cpu::MatMul(x, static_cast<const float*>(w.data), bias, y, m, n, k, accumulate);
}

void CpuDenseOps::RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m,
                          int64_t d) {
  UsePool();
  cpu::RmsNorm(x, weight, eps, y, m, d);
}

void CpuDenseOps::ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
                            int64_t heads, int64_t head_dim) {
  UsePool();
  cpu::ApplyRope(x, positions, inv_freq, n, heads, head_dim);
}

void CpuDenseOps::SiluMul(const float* gate, const float* up, float* out, int64_t n) {
  UsePool();
  cpu::SiluMul(gate, up, out, n);
}

void CpuDenseOps::GatherRows(WeightRef table, const int32_t* ids, int64_t n, int64_t width,
                             float* out) {
  const float* rows = static_cast<const float*>(table.data);
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(rows + int64_t{ids[i]} * width, width, out + i * width);
  }
}

void CpuDenseOps::TopCandidates(const float* logits, int64_t rows, int64_t vocab, int64_t k,
                                const double* temperatures, int32_t* ids, float* values,
                                double* normalisers) {
  const int64_t n = std::min(k, vocab);
  order_.resize(vocab);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * vocab;
    std::iota(order_.begin(), order_.end(), 0);
    std::partial_sort(order_.begin(), order_.begin() + n, order_.end(), [x](int32_t a, int32_t b) {
      return x[a] > x[b] || (x[a] == x[b] && a < b);
    });
    for (int64_t i = 0; i < n; ++i) {
      ids[r * n + i] = order_[i];
      values[r * n + i] = x[order_[i]];
    }
    const double t = temperatures[r];
    double sum = 0.0;
    if (t > 0.0) {
      const double max = values[r * n];
      for (int64_t i = 0; i < vocab; ++i) sum += std::exp((x[i] - max) / t);
    }
    normalisers[r] = sum;
  }
}

}  // namespace fluxion::model
