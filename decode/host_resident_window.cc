// The host ResidentWindow: each (slot, layer, KV head) gets ceil((sink + window) / page_tokens)
// pages of a private bf16 page arena in the host KV layout, so that the CPU paged kernel attends
// the resident rows exactly as it attends host pages (same bf16 rows, same kernel): the hybrid
// step over this window must then give the plain batched step's results up to the merge order.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "decode/resident_window.h"
#include "kernels/cpu/merge_state.h"
#include "kernels/cpu/paged_attention_cpu.h"

namespace fluxion::decode {

namespace {

class HostResidentWindow : public ResidentWindow {
 public:
  HostResidentWindow(const WindowShape& shape, int64_t page_tokens)
      : shape_(shape),
        page_tokens_(page_tokens),
        pages_per_head_((shape.rows_per_head() + page_tokens - 1) / page_tokens),
        page_bytes_(2 * page_tokens * shape.head_dim * sizeof(bf16)),
        arena_(static_cast<size_t>(shape.max_requests * shape.num_layers * shape.num_kv_heads *
                                   pages_per_head_) *
               page_bytes_),
        slots_(shape),
        lse_(shape.max_rows * shape.num_heads) {}

  const WindowShape& shape() const override { return shape_; }

  absl::StatusOr<int> Admit(const PagedKv& kv) override {
    absl::StatusOr<int64_t> n = slots_.CheckAdmit(kv);
    if (!n.ok()) return n.status();
    absl::StatusOr<int> slot = slots_.Take(*n);
    if (!slot.ok()) return slot.status();
    const kernels::PagedKvView src = kv.view();
    const int64_t d = shape_.head_dim, kpt = kv.shape().page_tokens;
    for (int layer = 0; layer < shape_.num_layers; ++layer) {
      for (int head = 0; head < shape_.num_kv_heads; ++head) {
        ForEachResidentToken(shape_, *n, [&](int64_t t) {
          const int32_t page = kv.pages(layer, head)[t / kpt];
          const int64_t row = t % kpt;
          std::memcpy(Key(*slot, layer, head, shape_.ring_row(t)), src.keys(page) + row * d,
                      d * sizeof(bf16));
          std::memcpy(Value(*slot, layer, head, shape_.ring_row(t)), src.values(page) + row * d,
                      d * sizeof(bf16));
        });
      }
    }
    return *slot;
  }

  void Release(int slot) override { slots_.Release(slot); }

  absl::Status BeginStep(absl::Span<const int> slots,
                         absl::Span<const int64_t> positions) override {
    if (absl::Status s = slots_.CheckStep(slots, positions); !s.ok()) return s;
    step_slots_.assign(slots.begin(), slots.end());
    positions_.assign(positions.begin(), positions.end());
    slots_.Advance(slots);
    return absl::OkStatus();
  }

  void AppendAndAttend(int layer, const float* q, const float* k, const float* v,
                       float* out) override {
    const int64_t d = shape_.head_dim, hq = shape_.num_heads, hkv = shape_.num_kv_heads;
    const int64_t group = hq / hkv;
    const kernels::PagedKvView view{arena_.data(), page_bytes_, page_tokens_, d};
    for (size_t i = 0; i < step_slots_.size(); ++i) {
      const int slot = step_slots_[i];
      const int64_t ring = shape_.ring_row(positions_[i]);
      const int64_t rows = shape_.resident_rows(positions_[i] + 1);
      for (int h = 0; h < hkv; ++h) {
        const float* kr = k + (i * hkv + h) * d;
        const float* vr = v + (i * hkv + h) * d;
        bf16* kd = Key(slot, layer, h, ring);
        bf16* vd = Value(slot, layer, h, ring);
        for (int64_t j = 0; j < d; ++j) {
          kd[j] = FloatToBf16(kr[j]);
          vd[j] = FloatToBf16(vr[j]);
        }
        spans_.clear();
        for (int64_t r = 0; r < rows; r += page_tokens_) {
          spans_.push_back({PageId(slot, layer, h, r / page_tokens_), 0,
                            static_cast<int32_t>(std::min(page_tokens_, rows - r))});
        }
        const int64_t h0 = i * hq + h * group;
        kernels::cpu::PagedAttention(view, spans_.data(), spans_.size(),
                                     {q + h0 * d, group, shape_.scale},
                                     {out + h0 * d, lse_.data() + h0});
      }
    }
  }

  void MergeHostStates(const float* host_out, const float* host_lse, float* out) override {
    kernels::cpu::MergeStates(out, lse_.data(), host_out, host_lse,
                              static_cast<int64_t>(step_slots_.size()) * shape_.num_heads,
                              shape_.head_dim);
  }

  absl::Status Sync() override { return absl::OkStatus(); }

 private:
  int32_t PageId(int slot, int layer, int head, int64_t p) const {
    return static_cast<int32_t>(
        ((static_cast<int64_t>(slot) * shape_.num_layers + layer) * shape_.num_kv_heads + head) *
            pages_per_head_ +
        p);
  }
  bf16* Key(int slot, int layer, int head, int64_t row) {
    return reinterpret_cast<bf16*>(arena_.data() +
                                   PageId(slot, layer, head, row / page_tokens_) * page_bytes_) +
           (row % page_tokens_) * shape_.head_dim;
  }
  bf16* Value(int slot, int layer, int head, int64_t row) {
    return Key(slot, layer, head, row) + page_tokens_ * shape_.head_dim;
  }

  const WindowShape shape_;
  const int64_t page_tokens_;
  const int64_t pages_per_head_;
  const size_t page_bytes_;
  std::vector<uint8_t> arena_;
  WindowSlots slots_;
  std::vector<int> step_slots_;  // the step's rows
  std::vector<int64_t> positions_;
  std::vector<float> lse_;       // [max_rows][num_heads]: the last AppendAndAttend's
  std::vector<kernels::PageSpan> spans_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ResidentWindow>> NewHostResidentWindow(const WindowShape& shape,
                                                                     int64_t page_tokens) {
  if (absl::Status s = ValidateWindowShape(shape); !s.ok()) return s;
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  if (!kernels::cpu::PagedAttentionSupported(shape.head_dim, group, page_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CPU paged kernel does not support head_dim ", shape.head_dim, ", GQA group ", group,
        ", page_tokens ", page_tokens));
  }
  return std::unique_ptr<ResidentWindow>(new HostResidentWindow(shape, page_tokens));
}

}  // namespace fluxion::decode
