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

absl::Status ValidateWindowShape(const WindowShape& s) {
  const std::pair<const char*, int64_t> positive[] = {
      {"num_layers", s.num_layers},       {"num_heads", s.num_heads},
      {"num_kv_heads", s.num_kv_heads},   {"head_dim", s.head_dim},
      {"window_tokens", s.window_tokens}, {"max_requests", s.max_requests},
      {"max_rows", s.max_rows}};
  for (const auto& [name, value] : positive) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("window shape: ", name, " must be positive, "
                                                     "not ", value));
    }
  }
  if (s.sink_tokens < 0) return absl::InvalidArgumentError("window shape: negative sink_tokens");
  if (s.num_heads % s.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("window shape: ", s.num_heads,
                                                   " query heads are not a multiple of ",
                                                   s.num_kv_heads, " KV heads"));
  }
  if (!(s.scale > 0.0f)) return absl::InvalidArgumentError("window shape: scale must be > 0");
  return absl::OkStatus();
}

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
        tokens_(shape.max_requests, -1),
        lse_(shape.max_rows * shape.num_heads) {}

  const WindowShape& shape() const override { return shape_; }

  absl::StatusOr<int> Admit(const PagedKv& kv) override {
    const KvShape& k = kv.shape();
    if (k.num_layers != shape_.num_layers || k.num_kv_heads != shape_.num_kv_heads ||
        k.head_dim != shape_.head_dim) {
      return absl::InvalidArgumentError("the request's KV shape is not the window's");
    }
    const int64_t n = kv.length(0);
    for (int layer = 1; layer < k.num_layers; ++layer) {
      if (kv.length(layer) != n) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " holds ",
                                                       kv.length(layer), " tokens, layer 0 ", n));
      }
    }
    int slot = -1;
    for (int s = 0; s < shape_.max_requests; ++s) {
      if (tokens_[s] < 0) {
        slot = s;
        break;
      }
    }
    if (slot < 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the resident window holds ", shape_.max_requests, " requests already"));
    }
    const kernels::PagedKvView src = kv.view();
    const int64_t d = shape_.head_dim, kpt = k.page_tokens;
    auto copy_token = [&](int layer, int head, int64_t t) {
      const int32_t page = kv.pages(layer, head)[t / kpt];
      const int64_t row = t % kpt;
      std::memcpy(Key(slot, layer, head, shape_.ring_row(t)), src.keys(page) + row * d,
                  d * sizeof(bf16));
      std::memcpy(Value(slot, layer, head, shape_.ring_row(t)), src.values(page) + row * d,
                  d * sizeof(bf16));
    };
    for (int layer = 0; layer < shape_.num_layers; ++layer) {
      for (int head = 0; head < shape_.num_kv_heads; ++head) {
        for (int64_t t = 0; t < std::min(n, shape_.sink_tokens); ++t) copy_token(layer, head, t);
        for (int64_t t = std::max(shape_.sink_tokens, n - shape_.window_tokens); t < n; ++t) {
          copy_token(layer, head, t);
        }
      }
    }
    tokens_[slot] = n;
    return slot;
  }

  void Release(int slot) override {
    if (slot >= 0 && slot < shape_.max_requests) tokens_[slot] = -1;
  }

  absl::Status BeginStep(absl::Span<const int> slots,
                         absl::Span<const int64_t> positions) override {
    if (static_cast<int64_t>(slots.size()) > shape_.max_rows || slots.size() != positions.size()) {
      return absl::InvalidArgumentError(absl::StrCat("a step of ", slots.size(), " rows and ",
                                                     positions.size(), " positions (at most ",
                                                     shape_.max_rows, " rows)"));
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      const int s = slots[i];
      if (s < 0 || s >= shape_.max_requests || tokens_[s] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("row ", i, ": slot ", s, " not admitted"));
      }
      if (positions[i] != tokens_[s]) {
        return absl::InvalidArgumentError(absl::StrCat("row ", i, ": position ", positions[i],
                                                       " but the slot holds ", tokens_[s],
                                                       " tokens"));
      }
    }
    slots_.assign(slots.begin(), slots.end());
    positions_.assign(positions.begin(), positions.end());
    for (int s : slots_) ++tokens_[s];  // every layer takes the step's token
    return absl::OkStatus();
  }

  void AppendAndAttend(int layer, const float* q, const float* k, const float* v,
                       float* out) override {
    const int64_t d = shape_.head_dim, hq = shape_.num_heads, hkv = shape_.num_kv_heads;
    const int64_t group = hq / hkv;
    const kernels::PagedKvView view{arena_.data(), page_bytes_, page_tokens_, d};
    for (size_t i = 0; i < slots_.size(); ++i) {
      const int slot = slots_[i];
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
                              static_cast<int64_t>(slots_.size()) * shape_.num_heads,
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
  std::vector<int64_t> tokens_;  // [slot]: tokens held, -1 when free
  std::vector<int> slots_;       // the step's rows
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
