#include "bench/attention_quality.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/half.h"
#include "kernels/cpu/topk.h"

namespace fluxion::bench {

void Metrics::Add(const Metrics& o) {
  rel_err += o.rel_err;
  recall += o.recall;
  overlap += o.overlap;
  read += o.read;
  guard_read += o.guard_read;
  n += o.n;
  overlap_n += o.overlap_n;
}

nlohmann::json Metrics::ToJson() const {
  return {{"rel_err", rel_err / n},
          {"recall", recall / n},
          {"overlap_topk",
           overlap_n > 0 ? nlohmann::json(overlap / overlap_n) : nlohmann::json(nullptr)},
          {"budget_spent", read / n},
          {"guard_read", guard_read / n},
          {"steps", n}};
}

void PrintQualityHeader(const std::string& first_column) {
  std::printf("%-16s %8s %-22s | %9s %8s %8s %7s %7s\n", first_column.c_str(), "context",
              "policy", "rel_err", "recall", "overlap", "read", "guard");
}

void Metrics::Print(const std::string& first, int64_t context, const std::string& label) const {
  std::printf("%-16s %8lld %-22s | %9.2e %8.4f %8.4f %7.4f %7.4f\n", first.c_str(),
              static_cast<long long>(context), label.c_str(), rel_err / n, recall / n,
              overlap_n > 0 ? overlap / overlap_n : NAN, read / n, guard_read / n);
}

// Recall and top-k overlap of one policy's selection for one (layer, KV head) at one step:
// recall = share of full attention's mass (from the stored bf16 keys, averaged over the group)
// on the selected rows; overlap = share of the exact top-k middle rows (same count as the policy
// chose between sinks and window) that it selected. Adds one step to `m` (rel_err excluded).
void AddSelectionQuality(const decode::PagedKv& kv, int layer, int kv_head, const float* q,
                         int64_t group, float scale, int64_t ctx,
                         const std::vector<kernels::PageSpan>& spans,
                         const decode::sparse::PolicyConfig& config, const float* full_lse,
                         int64_t rows_attended, Metrics* m) {
  const int64_t d = kv.shape().head_dim, pt = kv.shape().page_tokens;
  const auto& pages = kv.pages(layer, kv_head);
  std::vector<char> selected(ctx, 0);
  for (const auto& sp : spans) {
    const int64_t page_index = std::find(pages.begin(), pages.end(), sp.page) - pages.begin();
    for (int r = sp.first_row; r < sp.first_row + sp.rows; ++r) selected[page_index * pt + r] = 1;
  }
  std::vector<float> max_logit(ctx, -INFINITY);
  double recall = 0;
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    double mass = 0;
    for (int64_t t = 0; t < ctx; ++t) {
      const bf16* k = kv.view().keys(pages[t / pt]) + (t % pt) * d;
      double dot = 0;
      for (int64_t j = 0; j < d; ++j) dot += qg[j] * Bf16ToFloat(k[j]);
      const double logit = dot * scale;
      max_logit[t] = std::max(max_logit[t], static_cast<float>(logit));
      if (selected[t]) mass += std::exp(logit - full_lse[g]);
    }
    recall += mass / group;
  }
  m->recall += recall;
  const int64_t sink_end = std::min<int64_t>(config.sink_tokens, ctx);
  const int64_t local_begin = std::max(sink_end, ctx - config.local_tokens);
  int64_t chosen = 0;
  for (int64_t t = sink_end; t < local_begin; ++t) chosen += selected[t];
  if (chosen > 0) {
    std::vector<int32_t> top;
    kernels::cpu::TopKIndices(max_logit.data() + sink_end, local_begin - sink_end, chosen, &top);
    int64_t hit = 0;
    for (int32_t i : top) hit += selected[sink_end + i];
    m->overlap += static_cast<double>(hit) / chosen;
    ++m->overlap_n;
  }
  m->read += static_cast<double>(rows_attended) / ctx;
  ++m->n;
}

double RelativeError(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// y[rows] = w[rows][cols] . x[cols] in double.
std::vector<double> Project(const std::vector<float>& w, int64_t rows, int64_t cols,
                            const std::vector<float>& x) {
  std::vector<double> y(rows, 0.0);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) y[i] += double(w[i * cols + j]) * x[j];
  return y;
}

}  // namespace fluxion::bench
