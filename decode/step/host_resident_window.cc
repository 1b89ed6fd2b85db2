// The host ResidentWindow: each (slot, layer, KV head) gets ceil((sink + window) / page_tokens)
// pages of a private bf16 page arena in the host KV layout, so that the CPU paged kernel attends
// the resident rows exactly as it attends host pages (same bf16 rows, same kernel): the hybrid
// step over this window must then give the plain batched step's results up to the merge order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "decode/step/resident_window.h"
#include "kernels/cpu/compact_topk.h"
#include "kernels/cpu/merge_state.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/topk.h"
#include "kernels/cpu/selection.h"

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
        lse_(shape.max_rows * shape.num_heads),
        bounds_min_(shape.max_requests),
        bounds_max_(shape.max_requests),
        compact_values_(shape.compact_slots),
        compact_scales_(shape.compact_slots) {}

  const WindowShape& shape() const override { return shape_; }

  // One thread whatever `threads` says: the stand-in's copies are small.
  absl::StatusOr<int> Admit(const PagedKv& kv, int64_t score_block_tokens,
                            bool compact_keys) override {
    absl::StatusOr<int64_t> n = slots_.CheckAdmit(kv, score_block_tokens);
    if (!n.ok()) return n.status();
    absl::StatusOr<int> slot = slots_.Take(*n, score_block_tokens, compact_keys);
    if (!slot.ok()) return slot.status();
    if (slots_.score_block(*slot) > 0) LoadBounds(kv, *slot);
    if (const int32_t c = slots_.compact_index(*slot); c >= 0) LoadCompact(kv, c);
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

  absl::Status BeginStep(absl::Span<const int> slots, absl::Span<const int64_t> positions,
                         absl::Span<const uint8_t> score) override {
    if (absl::Status s = slots_.CheckStep(slots, positions); !s.ok()) return s;
    step_slots_.assign(slots.begin(), slots.end());
    positions_.assign(positions.begin(), positions.end());
    slots_.Advance(slots, score, &plan_, &compact_rows_);
    ranges_.clear();
    PlanPicks({}, compact_rows_, shape_.num_kv_heads, &picks_);
    return absl::OkStatus();
  }

  void RankBlocks(absl::Span<const sparse::ScoredBlocks::Range> ranges) override {
    ranges_.assign(ranges.begin(), ranges.end());
    ranges_.resize(step_slots_.size());
    top_offset_.assign(ranges_.size(), 0);
    int64_t total = 0;
    for (size_t i = 0; i < ranges_.size(); ++i) {
      sparse::ScoredBlocks::Range& r = ranges_[i];
      r.end = std::min(r.end, plan_.blocks[i]);
      r.want = std::clamp<int64_t>(r.want, 0, std::max<int64_t>(r.end - r.first, 0));
      top_offset_[i] = total;
      total += r.want * shape_.num_kv_heads;
    }
    top_.resize(total);
  }

  void ScoreBlocks(int layer, const float* q, const float* k) override {
    const int64_t d = shape_.head_dim, hq = shape_.num_heads, hkv = shape_.num_kv_heads;
    const int64_t group = hq / hkv, pt = shape_.page_tokens;
    scores_.resize(plan_.total);
    for (size_t i = 0; i < step_slots_.size(); ++i) {
      if (plan_.block[i] == 0) continue;
      const int64_t page = positions_[i] / pt;
      const bool first = positions_[i] % pt == 0;
      for (int h = 0; h < hkv; ++h) {
        float* mn = BoundsMin(step_slots_[i], layer, h);
        float* mx = BoundsMax(step_slots_[i], layer, h);
        const float* kr = k + (i * hkv + h) * d;
        for (int64_t j = 0; j < d; ++j) {
          // As PagedKv: the bounds describe the stored (bf16) key.
          const float key = RoundToBf16(kr[j]);
          mn[page * d + j] = first ? key : std::min(mn[page * d + j], key);
          mx[page * d + j] = first ? key : std::max(mx[page * d + j], key);
        }
        if (plan_.blocks[i] == 0) continue;  // bounds kept, no scores this step
        // The CPU policy's own kernel over the same bounds: the same scores, bit for bit.
        kernels::cpu::QuestBlockBounds(mn, mx, d, 0, plan_.blocks[i], plan_.block[i] / pt,
                                       q + (i * hq + h * group) * d, group,
                                       scores_.data() + plan_.offset[i] + h * plan_.blocks[i]);
        if (i < ranges_.size() && ranges_[i].want > 0) RankHead(i, h);
      }
    }
  }

  // The CPU's own compact selection (kernels/cpu/compact_topk.h), which the CUDA window's
  // CompactTopK equals bit for bit.
  void SelectRows(int layer, const float* q, const float* k,
                  absl::Span<const kernels::CompactPick> asked,
                  absl::Span<const uint64_t> masks) override {
    const int64_t d = shape_.head_dim, hq = shape_.num_heads, hkv = shape_.num_kv_heads;
    const int64_t group = hq / hkv;
    for (size_t i = 0; i < step_slots_.size(); ++i) {
      const int32_t c = compact_rows_[i];
      if (c < 0) continue;
      for (int h = 0; h < hkv; ++h) {
        const int64_t row = CompactRow(layer, h) + positions_[i];
        compact_scales_[c][row] = kernels::cpu::CompactKeyRowFromFloat(
            k + (i * hkv + h) * d, d, compact_values_[c].data() + row * d);
      }
    }
    PlanPicks(asked, compact_rows_, hkv, &picks_);
    picked_rows_.resize(picks_.total);
    for (size_t i = 0; i < step_slots_.size(); ++i) {
      for (int h = 0; h < hkv; ++h) {
        const kernels::CompactPick& p = picks_.picks[i * hkv + h];
        if (p.k <= 0) continue;
        kernels::cpu::CompactQueryGroup(q + (i * hq + h * group) * d, group, d, &query_);
        const int32_t c = compact_rows_[i];
        const int64_t first = CompactRow(layer, h);
        pick_scores_.resize(p.end - p.begin);
        for (int64_t t = p.begin; t < p.end; ++t) {
          pick_scores_[t - p.begin] =
              kernels::CompactCandidate(p, masks.data(), t - p.begin)
                  ? kernels::cpu::CompactGroupScore(query_,
                                                    compact_values_[c].data() + (first + t) * d,
                                                    compact_scales_[c][first + t])
                  : -INFINITY;
        }
        kernels::cpu::CompactTopKPositions(pick_scores_.data(), p.end - p.begin, p.k, p.begin,
                                           &picked_);
        std::copy(picked_.begin(), picked_.end(), picked_rows_.begin() + p.offset);
      }
    }
  }

  absl::Status WaitBlockScores() override { return absl::OkStatus(); }

  sparse::ScoredBlocks block_scores(int row) const override {
    sparse::ScoredBlocks scored;
    if (plan_.blocks[row] > 0) {
      scored = {scores_.data() + plan_.offset[row], plan_.blocks[row], plan_.block[row]};
      if (static_cast<size_t>(row) < ranges_.size() && ranges_[row].want > 0) {
        scored.top = top_.data() + top_offset_[row];
        scored.range = ranges_[row];
      }
    }
    // As the CUDA window: a layer that picked nothing hands nothing over.
    if (picks_.total > 0 && picks_.row_picked[row]) {
      const int64_t j = row * shape_.num_kv_heads;
      scored.picks = picked_rows_.data();
      scored.pick_offset = picks_.offset.data() + j;
      scored.pick_count = picks_.count.data() + j;
    }
    return scored;
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

  absl::StatusOr<kernels::PagedKvView> MappedView(const kernels::PagedKvView& host) override {
    return host;  // the stand-in's "device" is the host
  }

  void AttendMappedSpans(const kernels::PagedKvView& kv, const int64_t* indptr,
                         const kernels::PageSpan* spans, int64_t num_spans, const float* q,
                         float* out) override {
    const int64_t d = shape_.head_dim, hq = shape_.num_heads, hkv = shape_.num_kv_heads;
    const int64_t group = hq / hkv;
    mapped_out_.resize(group * d);
    mapped_lse_.resize(group);
    for (size_t i = 0; i < step_slots_.size(); ++i) {
      for (int64_t h = 0; h < hkv; ++h) {
        const int64_t pair = static_cast<int64_t>(i) * hkv + h;
        if (indptr[pair + 1] == indptr[pair]) continue;
        const int64_t h0 = i * hq + h * group;
        kernels::cpu::PagedAttention(kv, spans + indptr[pair], indptr[pair + 1] - indptr[pair],
                                     {q + h0 * d, group, shape_.scale},
                                     {mapped_out_.data(), mapped_lse_.data()});
        kernels::cpu::MergeStates(out + h0 * d, lse_.data() + h0, mapped_out_.data(),
                                  mapped_lse_.data(), group, d);
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
  // Row i's picks for KV head h from its scores (the CPU policy's own selection, so the CUDA
  // window's are checked against these), ascending, where block_scores() points.
  void RankHead(size_t i, int h) {
    const sparse::ScoredBlocks::Range& r = ranges_[i];
    const int64_t at = plan_.offset[i] + h * plan_.blocks[i];
    kernels::cpu::TopKIndices(scores_.data() + at + r.first, r.end - r.first, r.want, &picked_);
    std::sort(picked_.begin(), picked_.end());
    for (size_t j = 0; j < picked_.size(); ++j) {
      top_[top_offset_[i] + h * r.want + j] = static_cast<int32_t>(r.first + picked_[j]);
    }
  }

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

  // Compact rows of (layer, head) start at this row of a compact index's arrays.
  int64_t CompactRow(int layer, int head) const {
    return (static_cast<int64_t>(layer) * shape_.num_kv_heads + head) * shape_.max_context_tokens;
  }
  // The compact rows of every token `kv` holds ([layer][head][max_context_tokens][head_dim]).
  void LoadCompact(const PagedKv& kv, int32_t c) {
    const int64_t d = shape_.head_dim, pt = kv.shape().page_tokens, n = kv.length(0);
    const int64_t rows = shape_.num_layers * shape_.num_kv_heads * shape_.max_context_tokens;
    compact_values_[c].assign(rows * d, 0);
    compact_scales_[c].assign(rows, 0.0f);
    const kernels::PagedKvView src = kv.view();
    for (int layer = 0; layer < shape_.num_layers; ++layer) {
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        const std::vector<int32_t>& pages = kv.pages(layer, h);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = CompactRow(layer, h) + t;
          compact_scales_[c][row] = kernels::cpu::CompactKeyRow(
              src.keys(pages[t / pt]) + (t % pt) * d, d, compact_values_[c].data() + row * d);
        }
      }
    }
  }

  // The slot's page bounds from the host pages' metadata ([layer][head][max_pages][head_dim]).
  void LoadBounds(const PagedKv& kv, int slot) {
    const int64_t d = shape_.head_dim, pages = (kv.length(0) + shape_.page_tokens - 1) /
                                                  shape_.page_tokens;
    bounds_min_[slot].assign(BoundsPerSlot(), INFINITY);
    bounds_max_[slot].assign(BoundsPerSlot(), -INFINITY);
    for (int layer = 0; layer < shape_.num_layers; ++layer) {
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        std::copy_n(kv.key_min(layer, h), pages * d, BoundsMin(slot, layer, h));
        std::copy_n(kv.key_max(layer, h), pages * d, BoundsMax(slot, layer, h));
      }
    }
  }
  size_t BoundsPerSlot() const {
    return static_cast<size_t>(shape_.num_layers * shape_.num_kv_heads * shape_.max_pages() *
                               shape_.head_dim);
  }
  int64_t BoundsOffset(int layer, int head) const {
    return (static_cast<int64_t>(layer) * shape_.num_kv_heads + head) * shape_.max_pages() *
           shape_.head_dim;
  }
  float* BoundsMin(int slot, int layer, int head) {
    return bounds_min_[slot].data() + BoundsOffset(layer, head);
  }
  float* BoundsMax(int slot, int layer, int head) {
    return bounds_max_[slot].data() + BoundsOffset(layer, head);
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
  // Selection metadata: [slot] -> [layer][head][max_pages][head_dim] (allocated when scored).
  std::vector<std::vector<float>> bounds_min_, bounds_max_;
  StepScorePlan plan_;
  std::vector<float> scores_;
  std::vector<sparse::ScoredBlocks::Range> ranges_;  // [step row], RankBlocks's
  std::vector<int64_t> top_offset_;  // [step row]: where its picks start in top_
  std::vector<int32_t> top_, picked_;
  std::vector<float> mapped_out_, mapped_lse_;  // one pair's state of AttendMappedSpans
  // Device selection: [compact index] -> rows [layer][head][max_context_tokens] (allocated at
  // admission), the step's rows' compact indices and picks.
  std::vector<std::vector<int8_t>> compact_values_;
  std::vector<std::vector<float>> compact_scales_;
  std::vector<int32_t> compact_rows_;
  StepPickPlan picks_;
  std::vector<int32_t> picked_rows_;
  kernels::cpu::CompactQuery query_;
  std::vector<float> pick_scores_;
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
