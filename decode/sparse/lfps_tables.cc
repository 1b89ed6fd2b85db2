#include "decode/sparse/lfps_tables.h"

#include <algorithm>
#include <cmath>

namespace fluxion::decode::sparse {

DecayedTable::DecayedTable(double decay, int64_t rescale_every)
    : decay_(decay), rescale_every_(rescale_every) {}

void DecayedTable::Step() {
  g_ /= decay_;
  if (++steps_since_rescale_ >= rescale_every_) Rescale();
}

void DecayedTable::Rescale() {
  // Fold g back into the entries and recompute the moments exactly, dropping accumulated
  // rounding drift of the incremental sums.
  nonzero_ = 0;
  std::fill(std::begin(sum_), std::end(sum_), 0.0);
  std::vector<int64_t> still_nonzero;
  still_nonzero.reserve(nonzero_index_.size());
  for (int64_t i : nonzero_index_) {
    double& p = psi_[i];
    p /= g_;  // may underflow to 0: the entry then leaves the non-zero set
    if (p != 0.0) {
      AddToMoments(0.0, p);
      still_nonzero.push_back(i);
    }
  }
  nonzero_index_ = std::move(still_nonzero);
  g_ = 1.0;
  steps_since_rescale_ = 0;
}

void DecayedTable::AddToMoments(double old_psi, double new_psi) {
  if (old_psi == 0.0 && new_psi != 0.0) ++nonzero_;
  double o = 1.0, n = 1.0;
  for (int k = 1; k <= 4; ++k) {
    o *= old_psi;
    n *= new_psi;
    sum_[k] += n - o;
  }
}

void DecayedTable::Add(int64_t index, double w) {
  if (w <= 0.0 || index < 0) return;
  if (index >= size()) psi_.resize(index + 1, 0.0);
  const double old = psi_[index];
  psi_[index] = old + w * g_;
  if (old == 0.0 && psi_[index] != 0.0) nonzero_index_.push_back(index);
  AddToMoments(old, psi_[index]);
}

double DecayedTable::value(int64_t index) const {
  return index >= 0 && index < size() ? psi_[index] / g_ : 0.0;
}

TableMoments DecayedTable::moments() const {
  TableMoments m;
  m.count = nonzero_;
  if (nonzero_ == 0) return m;
  const double n = static_cast<double>(nonzero_);
  // Moments of Phi = Psi / g.
  const double e1 = sum_[1] / n / g_, e2 = sum_[2] / n / (g_ * g_);
  const double e3 = sum_[3] / n / (g_ * g_ * g_), e4 = sum_[4] / n / (g_ * g_ * g_ * g_);
  const double var = std::max(0.0, e2 - e1 * e1);
  m.mean = e1;
  m.stddev = std::sqrt(var);
  const double central4 = e4 - 4 * e1 * e3 + 6 * e1 * e1 * e2 - 3 * e1 * e1 * e1 * e1;
  m.kurtosis = var > 0 ? std::max(0.0, central4) / (var * var) : 0.0;
  return m;
}

void DecayedTable::SelectAbove(double a, int64_t min_count, int64_t max_count, int64_t lo,
                               int64_t hi, std::vector<int64_t>* out) const {
  const TableMoments m = moments();
  if (m.count == 0 || hi <= lo) return;
  const double threshold_psi = (m.mean + a * std::sqrt(m.kurtosis) * m.stddev) * g_;
  // Only the non-zero entries are visited (the tables are sparse: a dense scan of a 128K-entry
  // table per step was most of LFPS's step at long contexts).
  std::vector<int64_t>& eligible = scratch_;
  eligible.clear();
  std::vector<int64_t> picked;
  for (int64_t i : nonzero_index_) {
    if (i < lo || i >= hi) continue;
    eligible.push_back(i);
    if (psi_[i] >= threshold_psi) picked.push_back(i);
  }
  const int64_t want_min = std::min<int64_t>(min_count, eligible.size());
  if (static_cast<int64_t>(picked.size()) > max_count ||
      static_cast<int64_t>(picked.size()) < want_min) {
    // Re-select the k largest eligible entries instead.
    const int64_t k = static_cast<int64_t>(picked.size()) > max_count ? max_count : want_min;
    picked.clear();
    if (k > 0) {
      std::nth_element(eligible.begin(), eligible.begin() + (k - 1), eligible.end(),
                       [&](int64_t x, int64_t y) { return psi_[x] > psi_[y]; });
      picked.assign(eligible.begin(), eligible.begin() + k);
    }
  }
  std::sort(picked.begin(), picked.end());
  out->insert(out->end(), picked.begin(), picked.end());
}

}  // namespace fluxion::decode::sparse
