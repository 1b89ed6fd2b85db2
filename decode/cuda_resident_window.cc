#include "decode/cuda_resident_window.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode/hybrid_step_executor.h"
#include "decode/sparse/policy.h"
#include "kernels/cuda/decode_ops.h"
#include "model/cuda_dense_ops.h"
#include "kernels/cuda/window_ring.h"

namespace fluxion::decode {
namespace {

// cudaMalloc / cudaMallocHost memory freed on destruction.
struct DeviceMemory {
  void* p = nullptr;
  ~DeviceMemory() {
    if (p != nullptr) cudaFree(p);
  }
};
struct PinnedMemory {
  void* p = nullptr;
  ~PinnedMemory() {
    if (p != nullptr) cudaFreeHost(p);
  }
};

class CudaResidentWindow : public ResidentWindow {
 public:
  CudaResidentWindow(const WindowShape& shape, cudaStream_t stream)
      : shape_(shape), stream_(stream), slots_(shape) {}

  absl::Status Init() {
    const int64_t per_slot =
        shape_.num_layers * shape_.num_kv_heads * shape_.rows_per_head() * shape_.head_dim;
    const size_t ring_bytes = static_cast<size_t>(shape_.max_requests * per_slot) * sizeof(bf16);
    const size_t states = static_cast<size_t>(shape_.max_rows * shape_.num_heads);
    struct Want {
      DeviceMemory* m;
      size_t bytes;
    } wants[] = {{&k_, ring_bytes},
                 {&v_, ring_bytes},
                 {&slots_dev_, shape_.max_rows * sizeof(int32_t)},
                 {&positions_dev_, shape_.max_rows * sizeof(int64_t)},
                 {&lse_, states * sizeof(float)},
                 {&host_out_dev_, states * shape_.head_dim * sizeof(float)},
                 {&host_lse_dev_, states * sizeof(float)}};
    for (const Want& w : wants) {
      if (cudaMalloc(&w.m->p, w.bytes) != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(
            absl::StrCat("resident window: cannot allocate ", w.bytes, " bytes of device memory"));
      }
    }
    if (cudaMallocHost(&staging_.p, shape_.max_rows * (sizeof(int32_t) + sizeof(int64_t))) !=
        cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError("resident window: cannot allocate pinned staging");
    }
    ring_.num_layers = shape_.num_layers;
    ring_.num_kv_heads = shape_.num_kv_heads;
    ring_.head_dim = shape_.head_dim;
    ring_.sink = shape_.sink_tokens;
    ring_.window = shape_.window_tokens;
    ring_.k = static_cast<bf16*>(k_.p);
    ring_.v = static_cast<bf16*>(v_.p);
    per_slot_ = per_slot;
    return absl::OkStatus();
  }

  const WindowShape& shape() const override { return shape_; }

  absl::StatusOr<int> Admit(const PagedKv& kv) override {
    FLUXION_ASSIGN_OR_RETURN(const int64_t n, slots_.CheckAdmit(kv));
    const KvShape& k = kv.shape();
    // Gather the resident rows of every (layer, head) from the host pages into the slot's layout,
    // then one copy per K and V. Admission is off the step's hot path (once per request).
    const int64_t d = shape_.head_dim, rows = shape_.rows_per_head(), kpt = k.page_tokens;
    gather_k_.assign(per_slot_, bf16{});
    gather_v_.assign(per_slot_, bf16{});
    const kernels::PagedKvView src = kv.view();
    for (int layer = 0; layer < shape_.num_layers; ++layer) {
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        const int64_t base = (static_cast<int64_t>(layer) * shape_.num_kv_heads + h) * rows * d;
        auto copy_token = [&](int64_t t) {
          const int32_t page = kv.pages(layer, h)[t / kpt];
          const int64_t at = base + shape_.ring_row(t) * d;
          std::memcpy(&gather_k_[at], src.keys(page) + (t % kpt) * d, d * sizeof(bf16));
          std::memcpy(&gather_v_[at], src.values(page) + (t % kpt) * d, d * sizeof(bf16));
        };
        ForEachResidentToken(shape_, n, copy_token);
      }
    }
    FLUXION_ASSIGN_OR_RETURN(const int slot, slots_.Take(n));
    const size_t bytes = per_slot_ * sizeof(bf16);
    Record(cudaMemcpyAsync(ring_.k + slot * per_slot_, gather_k_.data(), bytes,
                           cudaMemcpyHostToDevice, stream_),
           "admit: copy K");
    Record(cudaMemcpyAsync(ring_.v + slot * per_slot_, gather_v_.data(), bytes,
                           cudaMemcpyHostToDevice, stream_),
           "admit: copy V");
    if (absl::Status s = Sync(); !s.ok()) {  // the gather buffers are reused next time
      slots_.Release(slot);
      return s;
    }
    return slot;
  }

  void Release(int slot) override { slots_.Release(slot); }

  absl::Status BeginStep(absl::Span<const int> slots,
                         absl::Span<const int64_t> positions) override {
    if (absl::Status s = slots_.CheckStep(slots, positions); !s.ok()) return s;
    // The staging is pinned and reused every step: the previous step's copy has run by now,
    // since every step ends by copying its logits to the host on the same stream.
    int32_t* staged_slots = static_cast<int32_t*>(staging_.p);
    int64_t* staged_positions = reinterpret_cast<int64_t*>(
        static_cast<char*>(staging_.p) + shape_.max_rows * sizeof(int32_t));
    for (size_t i = 0; i < slots.size(); ++i) {
      staged_slots[i] = slots[i];
      staged_positions[i] = positions[i];
    }
    slots_.Advance(slots);
    rows_ = static_cast<int64_t>(slots.size());
    Record(cudaMemcpyAsync(slots_dev_.p, staged_slots, rows_ * sizeof(int32_t),
                           cudaMemcpyHostToDevice, stream_),
           "step: copy slots");
    Record(cudaMemcpyAsync(positions_dev_.p, staged_positions, rows_ * sizeof(int64_t),
                           cudaMemcpyHostToDevice, stream_),
           "step: copy positions");
    return absl::OkStatus();
  }

  void AppendAndAttend(int layer, const float* q, const float* k, const float* v,
                       float* out) override {
    const auto* slots = static_cast<const int32_t*>(slots_dev_.p);
    const auto* positions = static_cast<const int64_t*>(positions_dev_.p);
    Record(kernels::cuda::RingAppend(ring_, layer, k, v, slots, positions, rows_, stream_),
           "RingAppend");
    Record(kernels::cuda::RingAttention(ring_, layer, q, shape_.num_heads, shape_.scale, slots,
                                        positions, rows_, out, static_cast<float*>(lse_.p),
                                        stream_),
           "RingAttention");
  }

  void MergeHostStates(const float* host_out, const float* host_lse, float* out) override {
    const int64_t states = rows_ * shape_.num_heads;
    // From pageable memory: the copy has read the host arrays when the call returns.
    Record(cudaMemcpyAsync(host_out_dev_.p, host_out, states * shape_.head_dim * sizeof(float),
                           cudaMemcpyHostToDevice, stream_),
           "merge: copy host outputs");
    Record(cudaMemcpyAsync(host_lse_dev_.p, host_lse, states * sizeof(float),
                           cudaMemcpyHostToDevice, stream_),
           "merge: copy host lse");
    Record(kernels::cuda::MergeStates(out, static_cast<float*>(lse_.p),
                                      static_cast<const float*>(host_out_dev_.p),
                                      static_cast<const float*>(host_lse_dev_.p), states,
                                      shape_.head_dim, stream_),
           "MergeStates");
  }

  absl::Status Sync() override {
    Record(cudaStreamSynchronize(stream_), "synchronize");
    absl::Status s = error_;
    error_ = absl::OkStatus();
    return s;
  }

 private:
  void Record(cudaError_t e, const char* what) {
    if (e != cudaSuccess && error_.ok()) {
      error_ = absl::InternalError(
          absl::StrCat("resident window: ", what, ": ", cudaGetErrorString(e)));
    }
  }

  const WindowShape shape_;
  const cudaStream_t stream_;
  kernels::cuda::RingLayout ring_;
  int64_t per_slot_ = 0;  // bf16 elements of one slot's K (or V)
  DeviceMemory k_, v_, slots_dev_, positions_dev_, lse_, host_out_dev_, host_lse_dev_;
  PinnedMemory staging_;
  WindowSlots slots_;
  std::vector<bf16> gather_k_, gather_v_;
  int64_t rows_ = 0;
  absl::Status error_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ResidentWindow>> NewCudaResidentWindow(const WindowShape& shape,
                                                                     cudaStream_t stream) {
  if (absl::Status s = ValidateWindowShape(shape); !s.ok()) return s;
  if (shape.head_dim != 32 && shape.head_dim != 64 && shape.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CUDA resident window supports head_dim 32, 64 and 128, not ", shape.head_dim));
  }
  if (shape.rows_per_head() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CUDA resident window holds at most 256 rows per head, not ", shape.rows_per_head()));
  }
  auto window = std::make_unique<CudaResidentWindow>(shape, stream);
  if (absl::Status s = window->Init(); !s.ok()) return s;
  return std::unique_ptr<ResidentWindow>(std::move(window));
}

absl::StatusOr<std::unique_ptr<StepExecutor>> NewCudaHybridStepExecutor(
    const model::Model* model, const kernels::cpu::CpuPool* pool, int64_t max_requests) {
  const WindowShape w = WindowShapeFor(model->attention_shape(), max_requests);
  FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<model::DenseOps> ops, model::NewCudaDenseOps(0));
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<ResidentWindow> window,
      NewCudaResidentWindow(w, static_cast<cudaStream_t>(ops->native_stream())));
  FLUXION_ASSIGN_OR_RETURN(
      std::unique_ptr<HybridStepExecutor> executor,
      HybridStepExecutor::Create(model, std::move(ops), std::move(window), pool));
  return std::unique_ptr<StepExecutor>(std::move(executor));
}

}  // namespace fluxion::decode
