#include "decode/resident_window.h"

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

absl::StatusOr<int> WindowSlots::Take(int64_t tokens, int64_t score_block_tokens) {
  absl::MutexLock lock(&mu_);
  for (int s = 0; s < shape_.max_requests; ++s) {
    if (tokens_[s] < 0) {
      tokens_[s] = tokens;
      // A context that does not fit the metadata now never will (contexts only grow).
      score_block_[s] = tokens < shape_.max_context_tokens ? score_block_tokens : 0;
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
                          StepScorePlan* plan) {
  absl::MutexLock lock(&mu_);
  const size_t rows = slots.size();
  plan->block.assign(rows, 0);
  plan->blocks.assign(rows, 0);
  plan->offset.assign(rows, -1);
  plan->total = 0;
  plan->max_blocks = 0;
  for (size_t i = 0; i < rows; ++i) {
    const int s = slots[i];
    const int64_t context = ++tokens_[s];  // the step's token included
    if (context > shape_.max_context_tokens) score_block_[s] = 0;
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

}  // namespace fluxion::decode
