#include "decode/device/cuda_resident_window.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "decode/step/hybrid_step_executor.h"
#include "decode/sparse/policy.h"
#include "kernels/cuda/decode_ops.h"
#include "model/cuda_dense_ops.h"
#include "kernels/cuda/attention_backend_cuda.h"
#include "kernels/cpu/compact_topk.h"
#include "kernels/cuda/block_scores.h"
#include "kernels/cuda/compact_select.h"
#include "kernels/cuda/top_blocks.h"
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

// Device (or pinned host) memory that grows to the largest size asked. Growing frees and
// reallocates, which synchronises the device, so it happens only while step sizes still grow.
class GrowingBuffer {
 public:
  explicit GrowingBuffer(bool pinned) : pinned_(pinned) {}
  ~GrowingBuffer() { Free(); }
  absl::Status Reserve(size_t bytes) {
    if (bytes <= capacity_) return absl::OkStatus();
    Free();
    bytes = std::max(bytes, 2 * capacity_);
    const cudaError_t e = pinned_ ? cudaMallocHost(&p_, bytes) : cudaMalloc(&p_, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      p_ = nullptr;
      return absl::ResourceExhaustedError(absl::StrCat(
          "resident window: cannot allocate ", bytes, pinned_ ? " pinned" : " device", " bytes"));
    }
    capacity_ = bytes;
    return absl::OkStatus();
  }
  void* get() const { return p_; }

 private:
  void Free() {
    if (p_ != nullptr) pinned_ ? cudaFreeHost(p_) : cudaFree(p_);
    p_ = nullptr;
    capacity_ = 0;
  }
  const bool pinned_;
  void* p_ = nullptr;
  size_t capacity_ = 0;
};

// Scratch of AttendMappedSpans: the span lists (pinned staging and device copy), the device
// partial states and the backend's workspace.
class MappedScratch {
 public:
  absl::Status Reserve(size_t list_bytes, int64_t states, int64_t head_dim) {
    FLUXION_RETURN_IF_ERROR(staging_.Reserve(list_bytes));
    FLUXION_RETURN_IF_ERROR(lists_.Reserve(list_bytes));
    FLUXION_RETURN_IF_ERROR(out_.Reserve(states * head_dim * sizeof(float)));
    return lse_.Reserve(states * sizeof(float));
  }
  absl::Status ReserveWorkspace(size_t bytes) { return workspace_.Reserve(bytes); }
  void* staging() const { return staging_.get(); }
  void* lists() const { return lists_.get(); }
  float* out() const { return static_cast<float*>(out_.get()); }
  float* lse() const { return static_cast<float*>(lse_.get()); }
  absl::Span<std::byte> workspace(size_t bytes) const {
    return {static_cast<std::byte*>(workspace_.get()), bytes};
  }

 private:
  GrowingBuffer staging_{true}, lists_{false}, out_{false}, lse_{false}, workspace_{false};
};

// Creates each event without timing; a failed one stays null (the window's destructor destroys
// the rest).
absl::Status CreateEvents(std::initializer_list<cudaEvent_t*> events) {
  for (cudaEvent_t* e : events) {
    if (cudaEventCreateWithFlags(e, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      *e = nullptr;
      return absl::InternalError("resident window: cannot create an event");
    }
  }
  return absl::OkStatus();
}

// The first error of one admission (Admit has its own: the step's errors are another thread's).
struct AdmitErrors {
  absl::Status status;
  void Record(cudaError_t e, const char* what) {
    if (e != cudaSuccess && status.ok()) {
      status = absl::InternalError(
          absl::StrCat("resident window: ", what, ": ", cudaGetErrorString(e)));
    }
  }
};

class CudaResidentWindow : public ResidentWindow {
 public:
  CudaResidentWindow(const WindowShape& shape, cudaStream_t stream, int64_t bounds_chunk_bytes)
      : shape_(shape),
        stream_(stream),
        slots_(shape),
        bounds_chunk_bytes_(std::max<int64_t>(bounds_chunk_bytes, 1)) {}

  absl::Status Init() {
    if (cudaGetDevice(&device_) != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError("resident window: no current CUDA device");
    }
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
    if (cudaStreamCreateWithFlags(&admit_stream_, cudaStreamNonBlocking) != cudaSuccess) {
      cudaGetLastError();
      admit_stream_ = nullptr;
      return absl::InternalError("resident window: cannot create the admission stream");
    }
    if (cudaMallocHost(&staging_.p, shape_.max_rows * 2 * (sizeof(int32_t) + sizeof(int64_t))) !=
        cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError("resident window: cannot allocate pinned staging");
    }
    if (shape_.max_context_tokens > 0) {
      if (absl::Status s = InitMetadata(); !s.ok()) return s;
    }
    if (shape_.compact_slots > 0 && shape_.max_context_tokens > 0) {
      if (absl::Status s = InitCompactKeys(); !s.ok()) return s;
    }
    // The zero-copy reads run on a stream of their own at the device's lowest priority, joined
    // to the step's stream by events: a read of host pages lasts as long as the CPU's share of
    // the layer (it is sized to), and at the same priority its blocks, queued first, held the
    // SMs while another pipeline's dense kernels waited behind them (ping-pong: that pipeline's
    // q/k/v, hence its CPU phase, came late; EXECUTOR.md section 8). The dense ops' streams run
    // at the highest priority (model/cuda_dense_ops.cc), so their blocks go first as the reads'
    // blocks retire; nothing else changes for a single pipeline.
    int least_priority = 0, greatest_priority = 0;
    if (cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority) != cudaSuccess ||
        cudaStreamCreateWithPriority(&mapped_stream_, cudaStreamNonBlocking, least_priority) !=
            cudaSuccess) {
      cudaGetLastError();
      mapped_stream_ = nullptr;
      return absl::InternalError("resident window: cannot create the zero-copy stream");
    }
    if (absl::Status st = CreateEvents({&mapped_ready_, &mapped_done_}); !st.ok()) return st;
    kernels::cuda::CudaAttentionBackendOptions zero_copy;
    zero_copy.stream = mapped_stream_;
    zero_copy.kernel = kernels::cuda::PagedKernel::kV3;  // the best reader of pinned host pages
    FLUXION_ASSIGN_OR_RETURN(mapped_backend_,
                             kernels::cuda::CudaAttentionBackend::Create(zero_copy));
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

  // The page bounds of max_context_tokens per slot, the per-step score arrays and their pinned
  // host copy.
  absl::Status InitMetadata() {
    const size_t bounds = static_cast<size_t>(shape_.max_requests * shape_.num_layers *
                                              shape_.num_kv_heads * shape_.max_pages() *
                                              shape_.head_dim) *
                          sizeof(bf16);
    const size_t scores = static_cast<size_t>(shape_.max_rows * shape_.num_kv_heads *
                                              shape_.max_pages()) *
                          sizeof(float);
    struct Want {
      DeviceMemory* m;
      size_t bytes;
    } wants[] = {{&bounds_min_, bounds},
                 {&bounds_max_, bounds},
                 {&block_dev_, shape_.max_rows * sizeof(int32_t)},
                 {&offset_dev_, shape_.max_rows * sizeof(int64_t)},
                 {&scores_dev_, scores},
                 {&top_dev_, scores / sizeof(float) * sizeof(int32_t)},
                 {&ranges_dev_, RankingBytes()}};
    for (const Want& w : wants) {
      if (cudaMalloc(&w.m->p, w.bytes) != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(absl::StrCat(
            "resident window: cannot allocate ", w.bytes, " bytes of device memory for the page "
            "bounds of ", shape_.max_requests, " requests of up to ", shape_.max_context_tokens,
            " tokens; lower the device's max context or max requests"));
      }
    }
    if (cudaMallocHost(&scores_host_.p, scores) != cudaSuccess ||
        cudaMallocHost(&top_host_.p, scores / sizeof(float) * sizeof(int32_t)) != cudaSuccess ||
        cudaMallocHost(&ranges_stage_.p, RankingBytes()) != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError("resident window: cannot allocate pinned block scores");
    }
    if (absl::Status st = CreateEvents({&scores_ready_, &bounds_copied_[0], &bounds_copied_[1]});
        !st.ok()) {
      return st;
    }
    bounds_.num_layers = shape_.num_layers;
    bounds_.num_kv_heads = shape_.num_kv_heads;
    bounds_.head_dim = shape_.head_dim;
    bounds_.page_tokens = shape_.page_tokens;
    bounds_.max_pages = shape_.max_pages();
    bounds_.min = static_cast<bf16*>(bounds_min_.p);
    bounds_.max = static_cast<bf16*>(bounds_max_.p);
    return absl::OkStatus();
  }

  // Device selection's compact rows of compact_slots requests (kernels/compact_keys.h), the
  // step's compact indices and per-layer picks staged for the device.
  absl::Status InitCompactKeys() {
    compact_.num_layers = shape_.num_layers;
    compact_.num_kv_heads = shape_.num_kv_heads;
    compact_.head_dim = shape_.head_dim;
    compact_.max_tokens = shape_.max_context_tokens;
    const size_t rows = static_cast<size_t>(shape_.compact_slots * shape_.num_layers *
                                            shape_.num_kv_heads * shape_.max_context_tokens);
    const size_t pairs = static_cast<size_t>(shape_.max_rows * shape_.num_kv_heads);
    struct Want {
      DeviceMemory* m;
      size_t bytes;
    } wants[] = {{&compact_values_, rows * shape_.head_dim},
                 {&compact_scales_, rows * sizeof(float)},
                 {&compact_slots_dev_, shape_.max_rows * sizeof(int32_t)},
                 {&picks_dev_, pairs * sizeof(kernels::CompactPick)}};
    for (const Want& w : wants) {
      if (cudaMalloc(&w.m->p, w.bytes) != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(absl::StrCat(
            "resident window: cannot allocate ", w.bytes, " bytes of device memory for the "
            "compact keys of ", shape_.compact_slots, " requests of up to ",
            shape_.max_context_tokens, " tokens; lower --device-selection-gib"));
      }
    }
    // Staging: the step's compact indices, then each layer's picks (a layer's region is not
    // rewritten before the next step, by when its copy has run).
    if (cudaMallocHost(&compact_stage_.p, StagedIndexWords() * sizeof(int32_t) +
                                              shape_.num_layers * pairs *
                                                  sizeof(kernels::CompactPick)) != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError("resident window: cannot allocate pinned pick staging");
    }
    if (absl::Status st =
            CreateEvents({&picks_ready_, &compact_copied_[0], &compact_copied_[1]});
        !st.ok()) {
      return st;
    }
    compact_.values = static_cast<int8_t*>(compact_values_.p);
    compact_.scales = static_cast<float*>(compact_scales_.p);
    return absl::OkStatus();
  }

  // The compact indices' words in compact_stage_, even so that the picks after them (8-byte
  // aligned) start aligned.
  int64_t StagedIndexWords() const { return (shape_.max_rows + 1) / 2 * 2; }

  ~CudaResidentWindow() override {
    for (cudaEvent_t e : {picks_ready_, compact_copied_[0], compact_copied_[1]}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (cudaEvent_t e :
         {scores_ready_, bounds_copied_[0], bounds_copied_[1], mapped_ready_, mapped_done_}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (admit_stream_ != nullptr) cudaStreamDestroy(admit_stream_);
    if (mapped_stream_ != nullptr) cudaStreamDestroy(mapped_stream_);
  }

  const WindowShape& shape() const override { return shape_; }

  // Admissions run one at a time, on their own stream with their own errors: the step's stream
  // never queues behind an admission's copies, and the slot's rows are complete (the admission
  // stream synchronised) before Admit returns it.
  absl::StatusOr<int> Admit(const PagedKv& kv, int64_t score_block_tokens,
                            bool compact_keys) override {
    absl::MutexLock lock(&admit_mu_);
    // The calling thread may not be the step's: make the window's device current.
    if (cudaSetDevice(device_) != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError("resident window: cannot make its device current to admit");
    }
    FLUXION_ASSIGN_OR_RETURN(const int64_t n, slots_.CheckAdmit(kv, score_block_tokens));
    const KvShape& k = kv.shape();
    // Gather the resident rows of every (layer, head) from the host pages into the slot's layout,
    // then one copy per K and V. Admission is off the step's hot path (once per request).
    const int64_t d = shape_.head_dim, rows = shape_.rows_per_head(), kpt = k.page_tokens;
    gather_k_.assign(per_slot_, bf16{});
    gather_v_.assign(per_slot_, bf16{});
    const kernels::PagedKvView src = kv.view();
    ForEachHead([&](int layer, int h) {
      const int64_t base = (static_cast<int64_t>(layer) * shape_.num_kv_heads + h) * rows * d;
      auto copy_token = [&](int64_t t) {
        const int32_t page = kv.pages(layer, h)[t / kpt];
        const int64_t at = base + shape_.ring_row(t) * d;
        std::memcpy(&gather_k_[at], src.keys(page) + (t % kpt) * d, d * sizeof(bf16));
        std::memcpy(&gather_v_[at], src.values(page) + (t % kpt) * d, d * sizeof(bf16));
      };
      ForEachResidentToken(shape_, n, copy_token);
    });
    FLUXION_ASSIGN_OR_RETURN(const int slot, slots_.Take(n, score_block_tokens, compact_keys));
    AdmitErrors errors;
    if (slots_.score_block(slot) > 0) {
      if (absl::Status s = UploadBounds(kv, slot, &errors); !s.ok()) {
        errors.Record(cudaStreamSynchronize(admit_stream_), "admit: wait");
        slots_.Release(slot);
        return s;
      }
    }
    if (const int32_t c = slots_.compact_index(slot); c >= 0 && compact_.values != nullptr) {
      if (absl::Status s = UploadCompactKeys(kv, c, &errors); !s.ok()) {
        errors.Record(cudaStreamSynchronize(admit_stream_), "admit: wait");
        slots_.Release(slot);
        return s;
      }
    }
    const size_t bytes = per_slot_ * sizeof(bf16);
    errors.Record(cudaMemcpyAsync(ring_.k + slot * per_slot_, gather_k_.data(), bytes,
                                  cudaMemcpyHostToDevice, admit_stream_),
                  "admit: copy K");
    errors.Record(cudaMemcpyAsync(ring_.v + slot * per_slot_, gather_v_.data(), bytes,
                                  cudaMemcpyHostToDevice, admit_stream_),
                  "admit: copy V");
    // The gather buffers are reused next time, and the slot's rows must be there before a step.
    errors.Record(cudaStreamSynchronize(admit_stream_), "admit: wait for the copies");
    if (!errors.status.ok()) {
      slots_.Release(slot);
      return errors.status;
    }
    return slot;
  }

  // The slot's page bounds from the host pages' metadata, rounded to bf16 without loss (they
  // are bounds of bf16 keys). At 128K that is 2 x 256 heads x 8,192 pages x 128 values, ~1 GiB
  // of bf16, so it streams through two pinned chunks: the pool converts chunk c + 1 while the copy
  // engine moves chunk c (pageable memory copied at a fraction of pinned speed, and converting
  // it all on one thread first took most of a 128K admission). Runs before Admit's Sync.
  // ResourceExhausted when the pinned staging cannot be had; copy errors surface at Sync.
  absl::Status UploadBounds(const PagedKv& kv, int slot, AdmitErrors* errors) {
    const int64_t d = shape_.head_dim, heads = shape_.num_layers * shape_.num_kv_heads;
    const int64_t pages = (kv.length(0) + shape_.page_tokens - 1) / shape_.page_tokens;
    if (pages == 0) return absl::OkStatus();
    const int64_t head_elems = pages * d;  // one head's bounds of one array
    const int64_t per_chunk = std::clamp<int64_t>(
        bounds_chunk_bytes_ / (2 * head_elems * static_cast<int64_t>(sizeof(bf16))), 1, heads);
    const size_t chunk_bytes = 2 * per_chunk * head_elems * sizeof(bf16);  // min, then max
    for (GrowingBuffer& b : bounds_stage_) FLUXION_RETURN_IF_ERROR(b.Reserve(chunk_bytes));
    const size_t width = head_elems * sizeof(bf16);
    const size_t pitch = shape_.max_pages() * d * sizeof(bf16);
    const int64_t first = kernels::cuda::BoundsOffset(bounds_, slot, 0, 0);
    const int64_t row = shape_.max_pages() * d;  // elements between heads on the device
    for (int64_t c = 0, h0 = 0; h0 < heads; ++c, h0 += per_chunk) {
      const int b = static_cast<int>(c % 2);
      // The copy out of this buffer two chunks ago must be done before it is overwritten.
      if (c >= 2) {
        errors->Record(cudaEventSynchronize(bounds_copied_[b]), "admit: wait for a bounds copy");
      }
      const int64_t n = std::min(per_chunk, heads - h0);
      bf16* mn_out = static_cast<bf16*>(bounds_stage_[b].get());
      bf16* mx_out = mn_out + per_chunk * head_elems;
      RunOnPool(n, [&](int64_t i) {
        const int layer = static_cast<int>((h0 + i) / shape_.num_kv_heads);
        const int h = static_cast<int>((h0 + i) % shape_.num_kv_heads);
        const float* mn = kv.key_min(layer, h);
        const float* mx = kv.key_max(layer, h);
        for (int64_t j = 0; j < head_elems; ++j) {
          mn_out[i * head_elems + j] = FloatToBf16(mn[j]);
          mx_out[i * head_elems + j] = FloatToBf16(mx[j]);
        }
      });
      errors->Record(cudaMemcpy2DAsync(bounds_.min + first + h0 * row, pitch, mn_out, width,
                                       width, n, cudaMemcpyHostToDevice, admit_stream_),
                     "admit: copy page bounds");
      errors->Record(cudaMemcpy2DAsync(bounds_.max + first + h0 * row, pitch, mx_out, width,
                                       width, n, cudaMemcpyHostToDevice, admit_stream_),
                     "admit: copy page bounds");
      errors->Record(cudaEventRecord(bounds_copied_[b], admit_stream_),
                     "admit: record a bounds copy");
    }
    return absl::OkStatus();
  }

  // The slot's compact rows, quantized here from the host pages (kernels/cpu/compact_topk.h: the
  // rows CompactKeysAppend would have written) and streamed through two pinned chunks of whole
  // heads, as UploadBounds does. At 8B shapes and 128K tokens that is 256 heads x 128K rows x
  // 132 bytes, 4.4 GB. Runs before Admit's Sync; copy errors surface there.
  absl::Status UploadCompactKeys(const PagedKv& kv, int32_t c, AdmitErrors* errors) {
    const int64_t d = shape_.head_dim, heads = shape_.num_layers * shape_.num_kv_heads;
    const int64_t n = kv.length(0), pt = kv.shape().page_tokens;
    if (n == 0) return absl::OkStatus();
    const int64_t head_bytes = n * (d + static_cast<int64_t>(sizeof(float)));
    const int64_t per_chunk = std::clamp<int64_t>(bounds_chunk_bytes_ / head_bytes, 1, heads);
    for (GrowingBuffer& b : compact_stage_chunks_) {
      FLUXION_RETURN_IF_ERROR(b.Reserve(per_chunk * head_bytes));
    }
    const kernels::PagedKvView src = kv.view();
    const int64_t first_row = compact_.RowOffset(c, 0, 0);
    for (int64_t i = 0, h0 = 0; h0 < heads; ++i, h0 += per_chunk) {
      const int b = static_cast<int>(i % 2);
      if (i >= 2) {
        errors->Record(cudaEventSynchronize(compact_copied_[b]), "admit: wait for a key copy");
      }
      const int64_t count = std::min(per_chunk, heads - h0);
      int8_t* values = static_cast<int8_t*>(compact_stage_chunks_[b].get());
      float* scales = reinterpret_cast<float*>(values + per_chunk * n * d);
      RunOnPool(count, [&](int64_t j) {
        const int layer = static_cast<int>((h0 + j) / shape_.num_kv_heads);
        const int h = static_cast<int>((h0 + j) % shape_.num_kv_heads);
        const std::vector<int32_t>& pages = kv.pages(layer, h);
        for (int64_t t = 0; t < n; ++t) {
          scales[j * n + t] = kernels::cpu::CompactKeyRow(src.keys(pages[t / pt]) + (t % pt) * d,
                                                          d, values + (j * n + t) * d);
        }
      });
      const int64_t row = first_row + h0 * compact_.max_tokens;
      errors->Record(cudaMemcpy2DAsync(compact_.values + row * d, compact_.max_tokens * d, values,
                                       n * d, n * d, count, cudaMemcpyHostToDevice,
                                       admit_stream_),
                     "admit: copy compact keys");
      errors->Record(cudaMemcpy2DAsync(compact_.scales + row, compact_.max_tokens * sizeof(float),
                                       scales, n * sizeof(float), n * sizeof(float), count,
                                       cudaMemcpyHostToDevice, admit_stream_),
                     "admit: copy compact scales");
      errors->Record(cudaEventRecord(compact_copied_[b], admit_stream_),
                     "admit: record a key copy");
    }
    return absl::OkStatus();
  }

  void set_cpu_pool(const kernels::cpu::CpuPool* pool) override { pool_ = pool; }

  // fn(i) for i in [0, n) on the step's pool (set_cpu_pool), or the calling thread alone.
  void RunOnPool(int64_t n, absl::FunctionRef<void(int64_t)> fn) const {
    if (pool_ != nullptr) {
      pool_->ParallelFor(n, fn);
    } else {
      for (int64_t i = 0; i < n; ++i) fn(i);
    }
  }
  // fn(layer, kv_head) for every head of the model, on the pool.
  void ForEachHead(absl::FunctionRef<void(int, int)> fn) const {
    RunOnPool(static_cast<int64_t>(shape_.num_layers) * shape_.num_kv_heads, [&](int64_t i) {
      fn(static_cast<int>(i / shape_.num_kv_heads), static_cast<int>(i % shape_.num_kv_heads));
    });
  }

  void Release(int slot) override { slots_.Release(slot); }

  absl::Status BeginStep(absl::Span<const int> slots, absl::Span<const int64_t> positions,
                         absl::Span<const uint8_t> score) override {
    if (absl::Status s = slots_.CheckStep(slots, positions); !s.ok()) return s;
    // The staging is pinned and reused every step: the previous step's copy has run by now,
    // since every step ends by copying its logits to the host on the same stream.
    // Staging: positions and score offsets (int64), then slots and score blocks (int32).
    int64_t* staged_positions = static_cast<int64_t*>(staging_.p);
    int64_t* staged_offset = staged_positions + shape_.max_rows;
    int32_t* staged_slots = reinterpret_cast<int32_t*>(staged_offset + shape_.max_rows);
    int32_t* staged_block = staged_slots + shape_.max_rows;
    for (size_t i = 0; i < slots.size(); ++i) {
      staged_slots[i] = slots[i];
      staged_positions[i] = positions[i];
    }
    slots_.Advance(slots, score, &plan_, &compact_rows_);
    rows_ = static_cast<int64_t>(slots.size());
    PlanPicks({}, compact_rows_, shape_.num_kv_heads, &picks_);
    picks_issued_ = false;
    compact_step_ = compact_.values != nullptr &&
                    std::any_of(compact_rows_.begin(), compact_rows_.end(),
                                [](int32_t c) { return c >= 0; });
    if (compact_step_) {
      auto* staged = static_cast<int32_t*>(compact_stage_.p);
      std::copy(compact_rows_.begin(), compact_rows_.end(), staged);
      Record(cudaMemcpyAsync(compact_slots_dev_.p, staged, rows_ * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_),
             "step: copy compact indices");
    }
    ranges_.clear();
    ranks_ = false;
    top_total_ = 0;
    Record(cudaMemcpyAsync(slots_dev_.p, staged_slots, rows_ * sizeof(int32_t),
                           cudaMemcpyHostToDevice, stream_),
           "step: copy slots");
    Record(cudaMemcpyAsync(positions_dev_.p, staged_positions, rows_ * sizeof(int64_t),
                           cudaMemcpyHostToDevice, stream_),
           "step: copy positions");
    keeps_bounds_ = std::any_of(plan_.block.begin(), plan_.block.end(),
                                [](int32_t b) { return b > 0; });
    if (keeps_bounds_) {
      std::copy(plan_.block.begin(), plan_.block.end(), staged_block);
      std::copy(plan_.offset.begin(), plan_.offset.end(), staged_offset);
      Record(cudaMemcpyAsync(block_dev_.p, staged_block, rows_ * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_),
             "step: copy score blocks");
      Record(cudaMemcpyAsync(offset_dev_.p, staged_offset, rows_ * sizeof(int64_t),
                             cudaMemcpyHostToDevice, stream_),
             "step: copy score offsets");
    }
    return absl::OkStatus();
  }

  // The ranked rows' picks lie together (top_offset_), so only they cross to the host, and the
  // scores themselves cross only when a scored row is not ranked (its policy reads them).
  void RankBlocks(absl::Span<const sparse::ScoredBlocks::Range> ranges) override {
    if (!keeps_bounds_) return;
    ranges_.assign(ranges.begin(), ranges.end());
    ranges_.resize(rows_);
    top_offset_.assign(rows_, 0);
    top_total_ = 0;
    // The pinned staging is reused every step, safely for the reason BeginStep's is: the ranges,
    // then the picks' offsets.
    auto* staged = static_cast<kernels::cuda::TopBlocksRange*>(ranges_stage_.p);
    auto* staged_offsets = reinterpret_cast<int64_t*>(staged + shape_.max_rows);
    for (int64_t i = 0; i < rows_; ++i) {
      sparse::ScoredBlocks::Range& r = ranges_[i];
      r.end = std::min(r.end, plan_.blocks[i]);
      r.want = std::clamp<int64_t>(r.want, 0, std::max<int64_t>(r.end - r.first, 0));
      staged[i] = {r.first, r.end, r.want};
      top_offset_[i] = staged_offsets[i] = top_total_;
      top_total_ += r.want * shape_.num_kv_heads;
    }
    ranks_ = top_total_ > 0;
    if (!ranks_) return;
    Record(cudaMemcpyAsync(ranges_dev_.p, staged, RankingBytes(), cudaMemcpyHostToDevice,
                           stream_),
           "step: copy block ranges");
  }
  size_t RankingBytes() const {
    return shape_.max_rows * (sizeof(kernels::cuda::TopBlocksRange) + sizeof(int64_t));
  }
  // Whether a row of this step is scored and not ranked: its policy reads the scores.
  bool ScoresCross() const {
    for (int64_t i = 0; i < rows_; ++i) {
      const bool ranked = static_cast<size_t>(i) < ranges_.size() && ranges_[i].want > 0;
      if (plan_.blocks[i] > 0 && !ranked) return true;
    }
    return false;
  }

  void ScoreBlocks(int layer, const float* q, const float* k) override {
    if (!keeps_bounds_) return;
    const auto* slots = static_cast<const int32_t*>(slots_dev_.p);
    const auto* positions = static_cast<const int64_t*>(positions_dev_.p);
    const auto* block = static_cast<const int32_t*>(block_dev_.p);
    Record(kernels::cuda::PageBoundsAppend(bounds_, layer, k, slots, positions, block, rows_,
                                           stream_),
           "PageBoundsAppend");
    if (plan_.total == 0) return;  // bounds kept; no row wants scores this step
    Record(kernels::cuda::QuestBlockScores(bounds_, layer, q, shape_.num_heads, slots, positions,
                                           block, static_cast<const int64_t*>(offset_dev_.p),
                                           rows_, plan_.max_blocks,
                                           static_cast<float*>(scores_dev_.p), stream_),
           "QuestBlockScores");
    scores_cross_ = ScoresCross();
    if (scores_cross_) {
      Record(cudaMemcpyAsync(scores_host_.p, scores_dev_.p, plan_.total * sizeof(float),
                             cudaMemcpyDeviceToHost, stream_),
             "copy block scores");
    }
    if (ranks_) {
      const auto* ranges = static_cast<const kernels::cuda::TopBlocksRange*>(ranges_dev_.p);
      const auto* top_offsets = reinterpret_cast<const int64_t*>(ranges + shape_.max_rows);
      Record(kernels::cuda::TopBlocks(static_cast<const float*>(scores_dev_.p), block,
                                      positions, static_cast<const int64_t*>(offset_dev_.p),
                                      ranges, top_offsets, rows_, shape_.num_kv_heads,
                                      static_cast<int32_t*>(top_dev_.p), stream_),
             "TopBlocks");
      Record(cudaMemcpyAsync(top_host_.p, top_dev_.p, top_total_ * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream_),
             "copy top blocks");
    }
    Record(cudaEventRecord(scores_ready_, stream_), "record block scores");
  }

  void SelectRows(int layer, const float* q, const float* k,
                  absl::Span<const kernels::CompactPick> asked,
                  absl::Span<const uint64_t> masks) override {
    picks_issued_ = false;
    if (!compact_step_) return;
    const auto* compact = static_cast<const int32_t*>(compact_slots_dev_.p);
    Record(kernels::cuda::CompactKeysAppend(compact_, layer, k, compact,
                                            static_cast<const int64_t*>(positions_dev_.p), rows_,
                                            stream_),
           "CompactKeysAppend");
    PlanPicks(asked, compact_rows_, shape_.num_kv_heads, &picks_);
    if (picks_.total == 0) return;
    const int64_t pairs = rows_ * shape_.num_kv_heads;
    auto* staged = reinterpret_cast<kernels::CompactPick*>(
                       static_cast<int32_t*>(compact_stage_.p) + StagedIndexWords()) +
                   layer * shape_.max_rows * shape_.num_kv_heads;
    std::copy(picks_.picks.begin(), picks_.picks.end(), staged);
    const size_t scores = static_cast<size_t>(pairs * picks_.max_span) * sizeof(float);
    const size_t picked = static_cast<size_t>(picks_.total) * sizeof(int32_t);
    // The candidates' words go through one pinned staging buffer: the previous layer's copy is
    // done, since its picks were waited for (WaitBlockScores) before this layer began.
    const size_t mask_bytes = masks.size() * sizeof(uint64_t);
    for (absl::Status st : {pick_scores_.Reserve(scores), picked_dev_.Reserve(picked),
                            picked_host_.Reserve(picked), masks_stage_.Reserve(mask_bytes),
                            masks_dev_.Reserve(mask_bytes)}) {
      if (!st.ok() && error_.ok()) error_ = st;
    }
    if (!error_.ok()) return;
    Record(cudaMemcpyAsync(picks_dev_.p, staged, pairs * sizeof(kernels::CompactPick),
                           cudaMemcpyHostToDevice, stream_),
           "step: copy picks");
    if (!masks.empty()) {
      std::copy(masks.begin(), masks.end(), static_cast<uint64_t*>(masks_stage_.get()));
      Record(cudaMemcpyAsync(masks_dev_.get(), masks_stage_.get(), mask_bytes,
                             cudaMemcpyHostToDevice, stream_),
             "step: copy candidates");
    }
    Record(kernels::cuda::CompactTopK(compact_, layer, q, shape_.num_heads, compact,
                                      static_cast<const kernels::CompactPick*>(picks_dev_.p),
                                      static_cast<const uint64_t*>(masks_dev_.get()), rows_,
                                      picks_.max_span,
                                      static_cast<float*>(pick_scores_.get()),
                                      static_cast<int32_t*>(picked_dev_.get()), stream_),
           "CompactTopK");
    Record(cudaMemcpyAsync(picked_host_.get(), picked_dev_.get(), picked,
                           cudaMemcpyDeviceToHost, stream_),
           "copy picks");
    Record(cudaEventRecord(picks_ready_, stream_), "record picks");
    picks_issued_ = true;
  }

  absl::Status WaitBlockScores() override {
    if (picks_issued_) Record(cudaEventSynchronize(picks_ready_), "wait for picks");
    if (plan_.total > 0) Record(cudaEventSynchronize(scores_ready_), "wait for block scores");
    absl::Status s = error_;
    error_ = absl::OkStatus();
    return s;
  }

  sparse::ScoredBlocks block_scores(int row) const override {
    sparse::ScoredBlocks scored;
    if (plan_.blocks[row] > 0) {
      scored = {static_cast<const float*>(scores_host_.p) + plan_.offset[row], plan_.blocks[row],
                plan_.block[row]};
      if (!scores_cross_) scored.data = nullptr;  // every scored row is ranked: not copied
      if (static_cast<size_t>(row) < ranges_.size() && ranges_[row].want > 0) {
        scored.top = static_cast<const int32_t*>(top_host_.p) + top_offset_[row];
        scored.range = ranges_[row];
      }
    }
    if (picks_issued_ && picks_.row_picked[row]) {
      const int64_t j = row * shape_.num_kv_heads;
      scored.picks = static_cast<const int32_t*>(picked_host_.get());
      scored.pick_offset = picks_.offset.data() + j;
      scored.pick_count = picks_.count.data() + j;
    }
    return scored;
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

  absl::StatusOr<kernels::PagedKvView> MappedView(const kernels::PagedKvView& host) override {
    // Asked every time (a driver lookup): an arena freed and another mapped at the same address
    // may be registered differently or not at all.
    void* device = nullptr;
    if (cudaHostGetDevicePointer(&device, const_cast<uint8_t*>(host.arena), 0) != cudaSuccess) {
      cudaGetLastError();
      return absl::FailedPreconditionError(
          "the host KV arena is not pinned for the device (PinArenaForCuda)");
    }
    kernels::PagedKvView view = host;
    view.arena = static_cast<const uint8_t*>(device);
    // The zero-copy kernel's limits (head_dim, group, page size, alignment), asked of the backend
    // with a shapes-only problem (no requests: nothing is read; one span: the arena's checks
    // apply). A refusal keeps the rows on the CPU instead of failing the step in
    // AttendMappedSpans (the trained tiny model's head_dim 32 has no CUDA paged kernel).
    kernels::PagedDecodeProblem probe;
    probe.kv = view;
    probe.num_spans = 1;
    probe.num_qo_heads = shape_.num_heads;
    probe.num_kv_heads = shape_.num_kv_heads;
    probe.head_dim = shape_.head_dim;
    probe.sm_scale = shape_.scale;
    FLUXION_RETURN_IF_ERROR(mapped_backend_->Supports(probe));
    return view;
  }

  void AttendMappedSpans(const kernels::PagedKvView& kv, const int64_t* indptr,
                         const kernels::PageSpan* spans, int64_t num_spans, const float* q,
                         float* out) override {
    const int64_t pairs = rows_ * shape_.num_kv_heads, states = rows_ * shape_.num_heads;
    kernels::PagedDecodeProblem p;
    p.q = q;
    p.kv = kv;
    p.num_spans = num_spans;
    p.num_requests = rows_;
    p.num_qo_heads = shape_.num_heads;
    p.num_kv_heads = shape_.num_kv_heads;
    p.head_dim = shape_.head_dim;
    p.sm_scale = shape_.scale;
    // Device copies of the span lists from pinned staging (reused per layer: the layer before
    // finished with them when the step's q/k/v reached the host).
    const size_t indptr_bytes = (pairs + 1) * sizeof(int64_t);
    const size_t span_bytes = num_spans * sizeof(kernels::PageSpan);
    if (absl::Status s = mapped_.Reserve(indptr_bytes + span_bytes, states, shape_.head_dim);
        !s.ok()) {
      if (error_.ok()) error_ = s;
      return;
    }
    // The reads start once the step's stream has the layer's q (and the window's output they
    // merge into) in order.
    Record(cudaEventRecord(mapped_ready_, stream_), "zero-copy: record the layer's q");
    Record(cudaStreamWaitEvent(mapped_stream_, mapped_ready_, 0), "zero-copy: wait for q");
    std::memcpy(mapped_.staging(), indptr, indptr_bytes);
    std::memcpy(static_cast<char*>(mapped_.staging()) + indptr_bytes, spans, span_bytes);
    Record(cudaMemcpyAsync(mapped_.lists(), mapped_.staging(), indptr_bytes + span_bytes,
                           cudaMemcpyHostToDevice, mapped_stream_),
           "zero-copy: copy span lists");
    p.span_indptr = static_cast<const int64_t*>(mapped_.lists());
    p.spans = reinterpret_cast<const kernels::PageSpan*>(
        static_cast<const char*>(mapped_.lists()) + indptr_bytes);
    p.out = mapped_.out();
    p.lse = mapped_.lse();
    if (absl::Status s = mapped_backend_->Supports(p); !s.ok()) {
      if (error_.ok()) error_ = s;
      return;
    }
    const size_t workspace = mapped_backend_->WorkspaceBytes(p);
    if (absl::Status s = mapped_.ReserveWorkspace(workspace); !s.ok()) {
      if (error_.ok()) error_ = s;
      return;
    }
    if (absl::Status s = mapped_backend_->Run(p, mapped_.workspace(workspace)); !s.ok()) {
      if (error_.ok()) error_ = s;
      return;
    }
    // The step's stream merges after the reads; its next layer's q/k/v copy to the host waits
    // for that, so the staging and scratch above are free again when the next layer fills them.
    Record(cudaEventRecord(mapped_done_, mapped_stream_), "zero-copy: record the reads");
    Record(cudaStreamWaitEvent(stream_, mapped_done_, 0), "zero-copy: wait for the reads");
    Record(kernels::cuda::MergeStates(out, static_cast<float*>(lse_.p), mapped_.out(),
                                      mapped_.lse(), states, shape_.head_dim, stream_),
           "zero-copy: MergeStates");
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
  PinnedMemory staging_;  // the step's slots, positions, score blocks and offsets
  WindowSlots slots_;
  std::vector<bf16> gather_k_, gather_v_;
  // Selection metadata (when shape_.max_context_tokens > 0).
  kernels::cuda::PageBoundsLayout bounds_;
  DeviceMemory bounds_min_, bounds_max_, block_dev_, offset_dev_, scores_dev_;
  PinnedMemory scores_host_;
  // The step's block rankings (RankBlocks): ranges (host copy, pinned staging, device) and picks.
  std::vector<sparse::ScoredBlocks::Range> ranges_;
  PinnedMemory ranges_stage_, top_host_;
  DeviceMemory ranges_dev_, top_dev_;
  std::vector<int64_t> top_offset_;  // [step row]: where its picks start in top_host_
  int64_t top_total_ = 0;
  bool ranks_ = false;          // some row of the step is ranked
  bool scores_cross_ = true;    // the last ScoreBlocks copied the scores to the host
  cudaEvent_t scores_ready_ = nullptr;
  // Admission (Admit): one at a time, on its own stream, on the threads it was given.
  absl::Mutex admit_mu_;
  cudaStream_t admit_stream_ = nullptr;
  int device_ = 0;  // current when Init ran
  // Admission's page bounds in flight: two pinned chunks and the copy out of each.
  const int64_t bounds_chunk_bytes_;
  GrowingBuffer bounds_stage_[2] = {GrowingBuffer(true), GrowingBuffer(true)};
  cudaEvent_t bounds_copied_[2] = {nullptr, nullptr};
  const kernels::cpu::CpuPool* pool_ = nullptr;  // Admit's host threads (null: this thread)
  StepScorePlan plan_;
  bool keeps_bounds_ = false;  // some row of the step keeps page bounds
  // Device selection (shape_.compact_slots > 0): the compact rows, the step's rows' compact
  // indices (host and device), the picks asked (device) and made (device, pinned host).
  kernels::CompactKeysLayout compact_;
  DeviceMemory compact_values_, compact_scales_, compact_slots_dev_, picks_dev_;
  PinnedMemory compact_stage_;
  GrowingBuffer pick_scores_{false}, picked_dev_{false}, picked_host_{true};
  GrowingBuffer masks_stage_{true}, masks_dev_{false};  // the picks' candidate words
  GrowingBuffer compact_stage_chunks_[2] = {GrowingBuffer(true), GrowingBuffer(true)};
  cudaEvent_t compact_copied_[2] = {nullptr, nullptr};
  cudaEvent_t picks_ready_ = nullptr;
  std::vector<int32_t> compact_rows_;
  StepPickPlan picks_;
  bool compact_step_ = false;  // some row of the step keeps compact rows
  bool picks_issued_ = false;  // this layer's SelectRows made picks
  // Zero-copy reads of host pages.
  std::unique_ptr<kernels::cuda::CudaAttentionBackend> mapped_backend_;
  cudaStream_t mapped_stream_ = nullptr;  // lowest priority (Init says why)
  cudaEvent_t mapped_ready_ = nullptr;    // the step's stream reached the reads
  cudaEvent_t mapped_done_ = nullptr;     // the reads finished
  MappedScratch mapped_;
  int64_t rows_ = 0;
  absl::Status error_;
};

// The arena's memory registered with CUDA (page-locked, mapped) until the arena dies.
class CudaPin : public ArenaAttachment {
 public:
  explicit CudaPin(void* base) : base_(base) {}
  ~CudaPin() override { cudaHostUnregister(base_); }

 private:
  void* const base_;
};

}  // namespace

absl::Status PinArenaForCuda(KvArena* arena) {
  const cudaError_t e = cudaHostRegister(arena->base(), arena->bytes(),
                                         cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot pin the ", arena->bytes() >> 20, " MiB KV arena for the GPU: ",
        cudaGetErrorString(e), " (raise the memlock limit, ulimit -l, or lower --kv-pages)"));
  }
  arena->Attach(std::make_unique<CudaPin>(arena->base()));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ResidentWindow>> NewCudaResidentWindow(
    const WindowShape& shape, cudaStream_t stream, int64_t bounds_chunk_bytes) {
  if (absl::Status s = ValidateWindowShape(shape); !s.ok()) return s;
  if (shape.head_dim != 32 && shape.head_dim != 64 && shape.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CUDA resident window supports head_dim 32, 64 and 128, not ", shape.head_dim));
  }
  if (shape.rows_per_head() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CUDA resident window holds at most 256 rows per head, not ", shape.rows_per_head()));
  }
  auto window = std::make_unique<CudaResidentWindow>(shape, stream, bounds_chunk_bytes);
  if (absl::Status s = window->Init(); !s.ok()) return s;
  return std::unique_ptr<ResidentWindow>(std::move(window));
}

absl::StatusOr<PingPongStepExecutor::Pipeline> NewCudaPipeline(const WindowShape& shape,
                                                               int device) {
  PingPongStepExecutor::Pipeline p;
  FLUXION_ASSIGN_OR_RETURN(p.ops, model::NewCudaDenseOps(device));
  FLUXION_ASSIGN_OR_RETURN(
      p.window, NewCudaResidentWindow(shape, static_cast<cudaStream_t>(p.ops->native_stream())));
  return p;
}

PingPongStepExecutor::Options CudaPingPongOptions(int device) {
  PingPongStepExecutor::Options o;
  o.thread_init = [device]() -> absl::Status {
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  };
  return o;
}

}  // namespace fluxion::decode
