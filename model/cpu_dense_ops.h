// The CPU DenseOps (dense_ops.h): host memory, OpenBLAS products over the stacked rows of the
// batch, the AVX2 kernels of kernels/cpu for the rest. Synchronous; never fails.
//
// Threads: with a CpuPool, every operation runs on the pool's thread count (OpenBLAS's and
// OpenMP's set from it, kernels/cpu/cpu_pool.h); without one, on whatever cpu::SetNumThreads (or
// the libraries' defaults) left in effect, which is what Model::Forward has always done.
#ifndef FLUXION_MODEL_CPU_DENSE_OPS_H_
#define FLUXION_MODEL_CPU_DENSE_OPS_H_

#include <vector>

#include "kernels/cpu/cpu_pool.h"
#include "model/dense_ops.h"

namespace fluxion::model {

class CpuDenseOps : public DenseOps, public CandidateOps {
 public:
  // `pool` (may be null, see above) must outlive this.
  explicit CpuDenseOps(const kernels::cpu::CpuPool* pool = nullptr) : pool_(pool) {}

  absl::string_view name() const override { return "cpu"; }
  bool host_memory() const override { return true; }

  absl::StatusOr<std::unique_ptr<OpsBuffer>> Allocate(size_t bytes) override;
  void CopyFromHost(void* dst, const void* host_src, size_t bytes) override;
  void CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  void Copy(void* dst, const void* src, size_t bytes) override;
  // fp32: borrows `host` when host_memory() (no copy, as the model has always run), otherwise
  // copies it into an allocation (a subclass that stands in for a device, as the tests' fakes).
  absl::StatusOr<UploadedWeight> UploadWeight(const float* host, int64_t rows,
                                              int64_t cols) override;

  void MatMul(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n,
              int64_t k, bool accumulate) override;
  void RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m,
               int64_t d) override;
  void ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
                 int64_t heads, int64_t head_dim) override;
  void SiluMul(const float* gate, const float* up, float* out, int64_t n) override;
  void GatherRows(WeightRef table, const int32_t* ids, int64_t n, int64_t width,
                  float* out) override;

  absl::Status Sync() override { return absl::OkStatus(); }
  // Host weights are plain host memory: any host DenseOps may read them.
  bool CanUseWeightsOf(const DenseOps& owner) const override {
    return &owner == this || (host_memory() && owner.host_memory());
  }

  // CandidateOps on the host: a partial sort of each row (the kernel's radix select would buy
  // nothing here), the normaliser summed in id order as the device sums it.
  CandidateOps* candidates() override { return this; }
  void TopCandidates(const float* logits, int64_t rows, int64_t vocab, int64_t k,
                     const double* temperatures, int32_t* ids, float* values,
                     double* normalisers) override;

 private:
  void UsePool() const {
    if (pool_ != nullptr) pool_->ApplyToBlas();
  }
  const kernels::cpu::CpuPool* pool_;
  std::vector<int32_t> order_;  // TopCandidates scratch
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_CPU_DENSE_OPS_H_
