#include "decode/sparse/lfps_tables.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_pool.h"
#include "kernels/cpu/topk.h"

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
    psi_f32_[i] = static_cast<float>(p);
    if (p != 0.0) {
      AddToMoments(0.0, p);
      still_nonzero.push_back(i);
    }
  }
  nonzero_index_ = std::move(still_nonzero);
  clamp_floor_ = 0.0f;  // in units of Psi, which the rescale divides
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
  if (index >= size()) {
    psi_.resize(index + 1, 0.0);
    psi_f32_.resize(index + 1, 0.0f);
  }
  const double old = psi_[index];
  psi_[index] = old + w * g_;
  psi_f32_[index] = static_cast<float>(psi_[index]);
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

bool DecayedTable::SelectDense(double threshold_psi, int64_t min_count, int64_t max_count,
                               int64_t lo, int64_t hi, std::vector<int64_t>* out) const {
  const double* psi = psi_.data();
  const float* f32 = psi_f32_.data();
  // One pass counts the entries above the threshold (and the non-zero ones, for the clamps) and
  // gathers those at or above the clamp's floor (below), in chunks that idle threads of the step
  // share (RunAsTasks): at batch 1 a head-step is a layer's critical path while half the threads
  // wait (bench/results/perf-lfps-8b-128k-h200-20261204.txt).
  const int64_t chunks = std::max<int64_t>(1, (hi - lo) / kChunk);
  chunks_.resize(chunks);
  const float floor = clamp_floor_;
  kernels::cpu::RunAsTasks(chunks, [&](int64_t c) {
    Chunk& ch = chunks_[c];
    const int64_t a = lo + (hi - lo) * c / chunks, b = lo + (hi - lo) * (c + 1) / chunks;
    int64_t above = 0, nonzero = 0, positive = 0;
    for (int64_t i = a; i < b; ++i) {  // branch-free: vectorises
      above += psi[i] >= threshold_psi;
      nonzero += psi[i] != 0.0;
      positive += f32[i] > 0.0f;
    }
    ch.above = above;
    ch.nonzero = nonzero;
    ch.positive = positive;
    ch.index.clear();
    ch.values.clear();
    if (floor > 0.0f) {
      for (int64_t i = a; i < b; ++i) {
        if (f32[i] >= floor) {
          ch.index.push_back(static_cast<int32_t>(i - lo));
          ch.values.push_back(f32[i]);
        }
      }
    }
  });
  int64_t above = 0, nonzero = 0, positive_f32 = 0, at_floor = 0;
  for (const Chunk& ch : chunks_) {
    above += ch.above;
    nonzero += ch.nonzero;
    positive_f32 += ch.positive;
    at_floor += static_cast<int64_t>(ch.index.size());
  }
  const int64_t want_min = std::min<int64_t>(min_count, nonzero);
  if (above <= max_count && above >= want_min) {
    for (int64_t i = lo; i < hi; ++i) {
      if (psi[i] >= threshold_psi) out->push_back(i);
    }
    return true;
  }
  const int64_t k = above > max_count ? max_count : want_min;
  if (k == 0) return true;
  // The k largest fp32 images over the whole slice, zeros included, are the k largest non-zero
  // entries (ties toward lower indices, as over the gathered entries) as long as k positive
  // images exist; an entry whose image underflowed to 0 would tie with the zeros, so that case
  // gathers as before.
  if (k > positive_f32) return false;
  // The clamp's floor: the k largest lie in {f32 >= floor} whenever at least k images reach the
  // floor, and the ties at the k-th value all lie in it too, so selecting over that subset (in
  // index order: ties toward lower indices alike) gives the same picks as over the whole slice.
  // Psi only grows between rescales (Rescale resets the floor), so a floor under the last step's
  // k-th value keeps holding the last picks: the radix select then runs over about k entries
  // instead of the range (~0.1 of a 128K range at 8B shapes, where random weights make both
  // clamps bind every step).
  const float* values = f32 + lo;
  int64_t n = hi - lo;
  const int32_t* index = nullptr;  // subset position -> offset from lo (null: the whole slice)
  if (floor > 0.0f && at_floor >= k) {
    floor_index_.clear();
    floor_values_.clear();
    for (const Chunk& ch : chunks_) {
      floor_index_.insert(floor_index_.end(), ch.index.begin(), ch.index.end());
      floor_values_.insert(floor_values_.end(), ch.values.begin(), ch.values.end());
    }
    values = floor_values_.data();
    n = at_floor;
    index = floor_index_.data();
  }
  if (index == nullptr || n > 2 * k) {
    // Lower the floor to the (k + slack)-th largest of what is selected over: room for the clamp
    // to grow (its cap is a share of the context) before the floor stops holding k entries.
    const int64_t with_slack = std::min<int64_t>(n, k + k / 8 + 16);
    kernels::cpu::TopKIndices(values, n, with_slack, &top_);
    float lowest = INFINITY;
    for (int32_t j : top_) lowest = std::min(lowest, values[j]);
    clamp_floor_ = lowest;
    slack_values_.resize(top_.size());
    // The top k of those: ties toward lower indices needs them in index order.
    std::sort(top_.begin(), top_.end());
    for (size_t j = 0; j < top_.size(); ++j) slack_values_[j] = values[top_[j]];
    kernels::cpu::TopKIndices(slack_values_.data(), static_cast<int64_t>(top_.size()), k,
                              &slack_top_);
    for (int32_t& j : slack_top_) j = top_[j];
    top_.swap(slack_top_);
  } else {
    kernels::cpu::TopKIndices(values, n, k, &top_);
  }
  // Marking the picks and reading the marks back in order sorts them in O(n / 64 + k).
  picked_bits_.assign(static_cast<size_t>((n + 63) / 64), 0);
  for (int32_t j : top_) picked_bits_[j >> 6] |= uint64_t{1} << (j & 63);
  for (size_t w = 0; w < picked_bits_.size(); ++w) {
    for (uint64_t bits = picked_bits_[w]; bits != 0; bits &= bits - 1) {
      const int64_t j = static_cast<int64_t>(w) * 64 + __builtin_ctzll(bits);
      out->push_back(lo + (index != nullptr ? index[j] : j));
    }
  }
  return true;
}

void DecayedTable::SelectAbove(double a, int64_t min_count, int64_t max_count, int64_t lo,
                               int64_t hi, std::vector<int64_t>* out) const {
  const TableMoments m = moments();
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, size());
  if (m.count == 0 || hi <= lo) return;
  const double threshold_psi = (m.mean + a * std::sqrt(m.kurtosis) * m.stddev) * g_;
  // A table whose range is mostly non-zero (as after many steps of diffuse attention) is
  // counted in place; a sparse one is walked through its non-zero index below (a dense scan of
  // a 128K-entry table per step was most of LFPS's step at long contexts).
  if (nonzero_ * 4 >= hi - lo && SelectDense(threshold_psi, min_count, max_count, lo, hi, out)) {
    return;
  }
  std::vector<int64_t>& eligible = scratch_;
  std::vector<float>& values = scratch_values_;
  eligible.clear();
  values.clear();
  int64_t above = 0;
  auto visit = [&](int64_t i) {
    const double p = psi_[i];
    eligible.push_back(i);
    values.push_back(static_cast<float>(p));
    above += p >= threshold_psi;
  };
  // A dense range reaches here only when SelectDense could not decide (an fp32 image
  // underflowed): it is scanned in index order, which reads it sequentially.
  const bool dense = nonzero_ * 4 >= hi - lo;
  if (dense) {
    for (int64_t i = lo; i < hi; ++i) {
      if (psi_[i] != 0.0) visit(i);
    }
  } else {
    for (int64_t i : nonzero_index_) {
      if (i >= lo && i < hi) visit(i);
    }
  }
  const int64_t n = static_cast<int64_t>(eligible.size());
  const int64_t want_min = std::min<int64_t>(min_count, n);
  const size_t first = out->size();
  if (above > max_count || above < want_min) {
    // Re-select the k largest eligible entries instead: a radix select over their values (fp32
    // images of Psi: order-preserving up to ties the rounding creates, which the clamp breaks
    // toward lower indices).
    const int64_t k = above > max_count ? max_count : want_min;
    if (k > 0) {
      kernels::cpu::TopKIndices(values.data(), n, k, &top_);
      if (dense) {
        // `eligible` is in index order: marking the picks and reading the marks back in order
        // sorts them in O(n / 64 + k) (a std::sort of the k indices was ~10% of LFPS's
        // selection at 128K, perf).
        picked_bits_.assign(static_cast<size_t>((n + 63) / 64), 0);
        for (int32_t j : top_) picked_bits_[j >> 6] |= uint64_t{1} << (j & 63);
        for (size_t w = 0; w < picked_bits_.size(); ++w) {
          for (uint64_t bits = picked_bits_[w]; bits != 0; bits &= bits - 1) {
            out->push_back(eligible[w * 64 + __builtin_ctzll(bits)]);
          }
        }
        return;
      }
      for (int32_t j : top_) out->push_back(eligible[j]);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      if (psi_[eligible[j]] >= threshold_psi) out->push_back(eligible[j]);
    }
    if (dense) return;  // already in index order
  }
  std::sort(out->begin() + first, out->end());
}

}  // namespace fluxion::decode::sparse
