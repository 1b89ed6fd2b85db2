#include "bench/eval/capturing_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"

namespace fluxion::eval {

CapturingAttention::CapturingAttention(std::unique_ptr<model::SequenceAttention> inner,
                                       const model::AttentionShape& shape,
                                       const CaptureOptions& options,
                                       const model::DenseAttention* prefix)
    : inner_(std::move(inner)),
      shape_(shape),
      options_(options),
      keys_(shape.num_layers),
      rows_(shape.num_layers) {
  if (prefix == nullptr) return;
  const int64_t row = shape_.num_kv_heads * shape_.head_dim;
  for (int l = 0; l < shape_.num_layers; ++l) {
    keys_[l].assign(prefix->keys(l), prefix->keys(l) + prefix->length(l) * row);
  }
}

absl::Status CapturingAttention::Forward(int layer, int64_t pos0, int64_t n, const float* q,
                                         const float* k, const float* v, float* out) {
  if (layer < 0 || layer >= shape_.num_layers) {
    return inner_->Forward(layer, pos0, n, q, k, v, out);  // the inner attention reports it
  }
  const int64_t kv_row = shape_.num_kv_heads * shape_.head_dim;
  const int64_t held = static_cast<int64_t>(keys_[layer].size()) / kv_row;
  if (pos0 != held) {
    return absl::FailedPreconditionError(
        absl::StrCat("capturing attention holds ", held, " keys of layer ", layer,
                     " but tokens start at ", pos0, " (give it the prefill as prefix)"));
  }
  if (absl::Status s = inner_->Forward(layer, pos0, n, q, k, v, out); !s.ok()) return s;
  keys_[layer].insert(keys_[layer].end(), k, k + n * kv_row);

  const int64_t q_row = shape_.num_heads * shape_.head_dim;
  CapturedRows& rows = rows_[layer];
  for (int64_t i = std::max<int64_t>(0, options_.capture_from - pos0); i < n; ++i) {
    const int64_t position = pos0 + i;
    rows.positions.push_back(position);
    rows.q.insert(rows.q.end(), q + i * q_row, q + (i + 1) * q_row);
    rows.k.insert(rows.k.end(), k + i * kv_row, k + (i + 1) * kv_row);
    rows.v.insert(rows.v.end(), v + i * kv_row, v + (i + 1) * kv_row);
    rows.stats.resize(rows.stats.size() + shape_.num_heads * kNumRowStats);
    ComputeRowStats(shape_, options_, q + i * q_row, keys_[layer].data(), position,
                    rows.stats.data() + rows.stats.size() - shape_.num_heads * kNumRowStats);
  }
  return absl::OkStatus();
}

void ComputeRowStats(const model::AttentionShape& shape, const CaptureOptions& options,
                     const float* q_row, const float* keys, int64_t position, float* stats) {
  const int64_t d = shape.head_dim, group = shape.num_heads / shape.num_kv_heads;
  const int64_t n = position + 1;
  const int64_t sink_end = std::min(n, options.sink_tokens);
  const int64_t local_begin = std::max<int64_t>(0, n - options.local_window);
  // One head per iteration: each needs n dot products, about what the attention itself costs.
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < shape.num_heads; ++h) {
    const float* qh = q_row + h * d;
    const float* kh = keys + (h / group) * d;
    std::vector<double> scores(n);
    double max_score = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = kh + j * shape.num_kv_heads * d;
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(qh[c]) * kj[c];
      scores[j] = dot * shape.scale;
      max_score = std::max(max_score, scores[j]);
    }
    double z = 0, weighted = 0, sink = 0, local = 0;
    for (int64_t j = 0; j < n; ++j) {
      const double e = std::exp(scores[j] - max_score);
      z += e;
      weighted += e * scores[j];
      if (j < sink_end) sink += e;
      if (j >= local_begin) local += e;
    }
    float* out = stats + h * kNumRowStats;
    out[kSinkMass] = static_cast<float>(sink / z);
    out[kLocalMass] = static_cast<float>(local / z);
    // H = -sum p log p with p = e^(s - m) / z:  H = m + log z - sum p s.
    out[kEntropy] = static_cast<float>(max_score + std::log(z) - weighted / z);
  }
}

}  // namespace fluxion::eval
