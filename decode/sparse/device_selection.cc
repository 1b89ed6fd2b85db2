#include "decode/sparse/device_selection.h"

#include <algorithm>
#include <cmath>

#include "absl/numeric/bits.h"
#include "glog/logging.h"

namespace fluxion::decode::sparse {

DeviceAsk DeviceAskOf(const Regions& r, const std::vector<uint64_t>* candidates) {
  DeviceAsk ask;
  kernels::CompactPick& p = ask.pick;
  p.begin = static_cast<int32_t>(r.sink_end);
  p.end = static_cast<int32_t>(std::max(r.sink_end, r.local_begin));
  int64_t most = p.end - p.begin;
  if (candidates != nullptr) {
    CHECK_EQ(static_cast<int64_t>(candidates->size()), (most + 63) / 64)
        << "candidates over another span";
    most = 0;
    for (uint64_t w : *candidates) most += absl::popcount(w);
    ask.candidates = candidates;
  }
  p.k = static_cast<int32_t>(std::clamp<int64_t>(r.middle_rows_budget, 0, most));
  return ask;
}

void CompactSelection::SelectMiddle(const SelectionInput& in, const DeviceAsk& ask,
                                    std::vector<kernels::PageSpan>* middle,
                                    SelectionStats* stats) {
  const kernels::CompactPick& pick = ask.pick;
  if (pick.k <= 0) return;
  if (in.device_picks != nullptr) {
    CHECK_EQ(in.device_pick_count, pick.k) << "the device picked for another budget";
    AppendPositions(*in.kv, in.layer, in.kv_head, in.device_picks, pick.k, middle);
    ++stats->selections_ranked_elsewhere;
    return;
  }
  const int64_t d = in.kv->shape().head_dim, pt = in.kv->shape().page_tokens;
  const int64_t n = pick.end - pick.begin;
  kernels::cpu::CompactQueryGroup(in.q, in.group, d, &query_);
  row_.resize(d);
  scores_.resize(n);
  const int32_t* pages = in.kv->pages(in.layer, in.kv_head).data();
  const kernels::PagedKvView view = in.kv->view();
  // Non-candidates score -infinity, as on the device (CompactCandidate).
  kernels::CompactPick staged = pick;
  staged.mask = ask.candidates != nullptr ? 0 : -1;
  const uint64_t* words = ask.candidates != nullptr ? ask.candidates->data() : nullptr;
  for (int64_t t = pick.begin; t < pick.end; ++t) {
    if (!kernels::CompactCandidate(staged, words, t - pick.begin)) {
      scores_[t - pick.begin] = -INFINITY;
      continue;
    }
    const bf16* key = view.keys(pages[t / pt]) + (t % pt) * d;
    const float scale = kernels::cpu::CompactKeyRow(key, d, row_.data());
    scores_[t - pick.begin] = kernels::cpu::CompactGroupScore(query_, row_.data(), scale);
  }
  stats->k_rows_scored += n;
  kernels::cpu::CompactTopKPositions(scores_.data(), n, pick.k, pick.begin, &picks_);
  AppendPositions(*in.kv, in.layer, in.kv_head, picks_.data(),
                  static_cast<int64_t>(picks_.size()), middle);
}

}  // namespace fluxion::decode::sparse
