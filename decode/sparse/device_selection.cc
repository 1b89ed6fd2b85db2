#include "decode/sparse/device_selection.h"

#include <algorithm>

#include "glog/logging.h"

namespace fluxion::decode::sparse {

kernels::CompactPick CompactPickOf(const Regions& r) {
  kernels::CompactPick p;
  p.begin = static_cast<int32_t>(r.sink_end);
  p.end = static_cast<int32_t>(std::max(r.sink_end, r.local_begin));
  p.k = static_cast<int32_t>(std::clamp<int64_t>(r.middle_rows_budget, 0, p.end - p.begin));
  return p;
}

void CompactSelection::SelectMiddle(const SelectionInput& in, const Regions& r,
                                    std::vector<kernels::PageSpan>* middle,
                                    SelectionStats* stats) {
  const kernels::CompactPick pick = CompactPickOf(r);
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
  for (int64_t t = pick.begin; t < pick.end; ++t) {
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
