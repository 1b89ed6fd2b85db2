#include "decode/sparse/granularity.h"

#include <algorithm>
#include <functional>
#include <numeric>

namespace fluxion::decode::sparse {

int64_t ScanBlocks(const StepShape& shape, int64_t block) {
  const int64_t blocks = (shape.middle_rows + block - 1) / block;
  const int64_t want = (shape.over * shape.attend_rows + block - 1) / block;
  return std::min(blocks, std::max(want, shape.min_blocks));
}

double PredictStepMicros(const HostCostModel& cost, const StepShape& shape, int64_t block) {
  const double blocks = static_cast<double>((shape.middle_rows + block - 1) / block);
  const double d = static_cast<double>(shape.head_dim);
  const double meta_bytes = blocks * 2 * d * sizeof(float);  // min and max vectors
  // The scan's candidate rows come in whole blocks; scoring reads their K rows (bf16).
  const double score_rows = static_cast<double>(
      std::min(shape.middle_rows, ScanBlocks(shape, block) * block));
  const double score_bytes = score_rows * d * 2;
  const double attend_bytes = static_cast<double>(shape.attend_rows) * 2 * d * 2;  // K and V
  const double bytes = meta_bytes + score_bytes + attend_bytes;
  return bytes / (cost.read_gbps * 1e3) + blocks * cost.topk_ns_per_score * 1e-3;
}

std::vector<double> BlockMass(const std::vector<double>& mass, int64_t first_position,
                              int64_t block) {
  std::vector<double> out;
  for (size_t i = 0; i < mass.size(); ++i) {
    const int64_t b = (first_position + static_cast<int64_t>(i)) / block -
                      first_position / block;
    if (b >= static_cast<int64_t>(out.size())) out.resize(b + 1, 0.0);
    out[b] += mass[i];
  }
  return out;
}

double BlockCoverage(std::vector<double> block_mass, int64_t block, int64_t rows) {
  const double total = std::accumulate(block_mass.begin(), block_mass.end(), 0.0);
  if (total <= 0 || block_mass.empty()) return 1.0;
  const size_t top = std::min<size_t>(block_mass.size(), std::max<int64_t>(1, (rows + block - 1) / block));
  std::nth_element(block_mass.begin(), block_mass.begin() + (top - 1), block_mass.end(),
                   std::greater<double>());
  return std::accumulate(block_mass.begin(), block_mass.begin() + top, 0.0) / total;
}

GranularityChoice ChooseGranularity(const HostCostModel& cost, const StepShape& shape,
                                    const std::vector<double>& coverage, double tolerance) {
  GranularityChoice best;
  best.block = kFluxionBlocks[0];
  best.predicted_us = PredictStepMicros(cost, shape, best.block);
  best.coverage = coverage.empty() ? 1.0 : coverage[0];
  for (size_t i = 1; i < std::size(kFluxionBlocks) && i < coverage.size(); ++i) {
    const int64_t b = kFluxionBlocks[i];
    if (coverage[i] < coverage[0] - tolerance) continue;
    const double us = PredictStepMicros(cost, shape, b);
    if (us < best.predicted_us) best = {b, us, coverage[i]};
  }
  return best;
}

}  // namespace fluxion::decode::sparse
