#include "decode/step/resident_window.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "decode/sparse/policy.h"

namespace fluxion::decode {

absl::Status ValidateWindowShape(const WindowShape& s) {
  const std::pair<const char*, int64_t> positive[] = {
      {"num_layers", s.num_layers},       {"num_heads", s.num_heads},
      {"num_kv_heads", s.num_kv_heads},   {"head_dim", s.head_dim},
      {"window_tokens", s.window_tokens}, {"max_requests", s.max_requests},
      {"max_rows", s.max_rows},           {"page_tokens", s.page_tokens}};
  for (const auto& [name, value] : positive) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("window shape: ", name, " must be positive, "
                                                     "not ", value));
    }
  }
  if (s.sink_tokens < 0) return absl::InvalidArgumentError("window shape: negative sink_tokens");
  if (s.max_context_tokens < 0) {
    return absl::InvalidArgumentError("window shape: negative max_context_tokens");
  }
  if (s.num_heads % s.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("window shape: ", s.num_heads,
                                                   " query heads are not a multiple of ",
                                                   s.num_kv_heads, " KV heads"));
  }
  if (!(s.scale > 0.0f)) return absl::InvalidArgumentError("window shape: scale must be > 0");
  return absl::OkStatus();
}

WindowShape WindowShapeFor(const model::AttentionShape& attention, int64_t max_requests) {
  const sparse::PolicyConfig defaults;
  WindowShape w;
  w.num_layers = attention.num_layers;
  w.num_heads = attention.num_heads;
  w.num_kv_heads = attention.num_kv_heads;
  w.head_dim = attention.head_dim;
  w.scale = attention.scale;
  w.sink_tokens = defaults.sink_tokens;
  w.window_tokens = defaults.local_tokens;
  w.max_requests = max_requests;
  w.max_rows = max_requests;
  return w;
}

void ForEachResidentToken(const WindowShape& shape, int64_t tokens,
                          absl::FunctionRef<void(int64_t)> fn) {
  for (int64_t t = 0; t < std::min(tokens, shape.sink_tokens); ++t) fn(t);
  for (int64_t t = std::max(shape.sink_tokens, tokens - shape.window_tokens); t < tokens; ++t) {
    fn(t);
  }
}

absl::StatusOr<int64_t> WindowSlots::CheckAdmit(const PagedKv& kv,
                                                 int64_t score_block_tokens) const {
  const KvShape& k = kv.shape();
  if (k.num_layers != shape_.num_layers || k.num_kv_heads != shape_.num_kv_heads ||
      k.head_dim != shape_.head_dim) {
    return absl::InvalidArgumentError("the request's KV shape is not the window's");
  }
  if (score_block_tokens < 0 ||
      (score_block_tokens > 0 && score_block_tokens % shape_.page_tokens != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("score block of ", score_block_tokens,
                                                   " tokens: not a multiple of the window's ",
                                                   shape_.page_tokens, "-token pages"));
  }
  if (score_block_tokens > 0 && k.page_tokens != shape_.page_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("the request's pages hold ", k.page_tokens,
                                                   " tokens, the window's metadata ",
                                                   shape_.page_tokens));
  }
  const int64_t n = kv.length(0);
  for (int layer = 1; layer < k.num_layers; ++layer) {
    if (kv.length(layer) != n) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " holds ", kv.length(layer),
                                                     " tokens, layer 0 ", n));
    }
  }
  return n;
}

absl::StatusOr<int> WindowSlots::Take(int64_t tokens, int64_t score_block_tokens,
                                      bool compact_keys) {
  absl::MutexLock lock(&mu_);
  for (int s = 0; s < shape_.max_requests; ++s) {
    if (tokens_[s] < 0) {
      tokens_[s] = tokens;
      // A context that does not fit the metadata now never will (contexts only grow).
      score_block_[s] = tokens < shape_.max_context_tokens ? score_block_tokens : 0;
      compact_[s] = -1;
      if (compact_keys && tokens < shape_.max_context_tokens) {
        auto free = std::find(compact_used_.begin(), compact_used_.end(), 0);
        if (free != compact_used_.end()) {
          *free = 1;
          compact_[s] = static_cast<int32_t>(free - compact_used_.begin());
        }
      }
      return s;
    }
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("the resident window holds ", shape_.max_requests, " requests already"));
}

void WindowSlots::Release(int slot) {
  absl::MutexLock lock(&mu_);
  if (slot >= 0 && slot < shape_.max_requests) {
    tokens_[slot] = -1;
    score_block_[slot] = 0;
    if (compact_[slot] >= 0) compact_used_[compact_[slot]] = 0;
    compact_[slot] = -1;
  }
}

absl::Status WindowSlots::CheckStep(absl::Span<const int> slots,
                                    absl::Span<const int64_t> positions) const {
  absl::MutexLock lock(&mu_);
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
  return absl::OkStatus();
}

void WindowSlots::Advance(absl::Span<const int> slots, absl::Span<const uint8_t> score,
                          StepScorePlan* plan, std::vector<int32_t>* compact) {
  absl::MutexLock lock(&mu_);
  const size_t rows = slots.size();
  compact->assign(rows, -1);
  plan->block.assign(rows, 0);
  plan->blocks.assign(rows, 0);
  plan->offset.assign(rows, -1);
  plan->total = 0;
  plan->max_blocks = 0;
  for (size_t i = 0; i < rows; ++i) {
    const int s = slots[i];
    const int64_t context = ++tokens_[s];  // the step's token included
    if (context > shape_.max_context_tokens) {
      score_block_[s] = 0;
      if (compact_[s] >= 0) compact_used_[compact_[s]] = 0;
      compact_[s] = -1;
    }
    (*compact)[i] = compact_[s];
    const int64_t block = score_block_[s];
    if (block == 0) continue;
    plan->block[i] = static_cast<int32_t>(block);
    if (!score.empty() && !score[i]) continue;
    plan->blocks[i] = (context + block - 1) / block;
    plan->offset[i] = plan->total;
    plan->total += shape_.num_kv_heads * plan->blocks[i];
    plan->max_blocks = std::max(plan->max_blocks, plan->blocks[i]);
  }
}

void PlanPicks(absl::Span<const kernels::CompactPick> asked, absl::Span<const int32_t> compact,
               int64_t num_kv_heads, StepPickPlan* plan) {
  const int64_t rows = static_cast<int64_t>(compact.size());
  plan->picks.assign(rows * num_kv_heads, kernels::CompactPick{});
  plan->offset.assign(rows * num_kv_heads, 0);
  plan->count.assign(rows * num_kv_heads, 0);
  plan->row_picked.assign(rows, 0);
  plan->total = 0;
  plan->max_span = 0;
  if (static_cast<int64_t>(asked.size()) != rows * num_kv_heads) return;
  for (int64_t i = 0; i < rows; ++i) {
    if (compact[i] < 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t j = i * num_kv_heads + h;
      kernels::CompactPick p = asked[j];
      if (p.k < 0) continue;
      plan->row_picked[i] = 1;
      p.end = std::max(p.begin, p.end);
      p.k = std::min(p.k, p.end - p.begin);
      p.offset = plan->total;
      plan->picks[j] = p;
      plan->offset[j] = p.offset;
      plan->count[j] = p.k;
      plan->total += p.k;
      if (p.k > 0) plan->max_span = std::max<int64_t>(plan->max_span, p.end - p.begin);
    }
  }
}

}  // namespace fluxion::decode
