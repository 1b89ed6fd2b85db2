// LFPS history tables of one KV head (docs/ALGORITHMS.md §1.3.2-1.3.4): a vertical
// table over absolute key positions and a slash table over distances back from the query, both
// exponentially decayed sums of the attention weights past decode steps gave each entry.
//
//   Phi_ver[j] <- r * Phi_ver[j] + w_t(j)        Phi_sla[d] <- r * Phi_sla[d] + w_t(t - d)
//
// Decaying every entry every step would cost as much as the scan LFPS avoids, so the tables hold
// Psi = Phi * g with g = r^-(steps since the last rescale): a step only multiplies g by 1/r, an
// update adds w * g to one entry. Psi grows like r^-t, and the fourth-moment sums kept for the
// kurtosis threshold like r^-4t, which overflows fp32 after ~430 steps; everything is fp64 and
// rescaled (Psi /= g, g = 1, moments recomputed exactly) every `rescale_every` steps.
//
// Thread-compatible: one table pair per (request, layer, KV head), driven by one thread (its
// selection keeps a floor between steps, so even const calls must not run concurrently).
#ifndef FLUXION_DECODE_SPARSE_LFPS_TABLES_H_
#define FLUXION_DECODE_SPARSE_LFPS_TABLES_H_

#include <cstdint>
#include <limits>
#include <vector>

namespace fluxion::decode::sparse {

// Mean, standard deviation and kurtosis of a table's non-zero entries (Phi, not Psi).
struct TableMoments {
  int64_t count = 0;
  double mean = 0, stddev = 0, kurtosis = 0;
};

class DecayedTable {
 public:
  explicit DecayedTable(double decay, int64_t rescale_every);

  // Moves to the next step: every entry decays by `decay`.
  void Step();
  // Phi[index] += w (w >= 0). Grows the table as needed.
  void Add(int64_t index, double w);
  double value(int64_t index) const;  // Phi
  int64_t size() const { return static_cast<int64_t>(psi_.size()); }

  TableMoments moments() const;
  // Indices in [lo, hi) whose Phi >= mean + a * sqrt(kurtosis) * stddev (the moments are the
  // whole table's, non-zero entries only), clamped to the `max_count` largest when more qualify
  // and widened to the `min_count` largest non-zero entries of [lo, hi) when fewer do. Appends to
  // *out in index order.
  //
  // The range is what makes the clamps mean something: LFPS attends sinks and the local window
  // anyway, and their entries (recent tokens, small distances) are the heaviest of both tables on
  // most heads, so an unrestricted top-`min_count` was mostly spent on rows already attended and
  // left the region the budget is for with a handful of candidates (docs/SPARSE.md, "Two changes
  // from the published method").
  void SelectAbove(double a, int64_t min_count, int64_t max_count, int64_t lo, int64_t hi,
                   std::vector<int64_t>* out) const;
  void SelectAbove(double a, int64_t min_count, int64_t max_count,
                   std::vector<int64_t>* out) const {
    SelectAbove(a, min_count, max_count, 0, std::numeric_limits<int64_t>::max(), out);
  }

 private:
  void Rescale();
  // SelectAbove over a mostly non-zero range, in place; false when it cannot decide the clamp
  // exactly from the fp32 images (the caller then gathers the non-zero entries).
  bool SelectDense(double threshold_psi, int64_t min_count, int64_t max_count, int64_t lo,
                   int64_t hi, std::vector<int64_t>* out) const;
  void AddToMoments(double old_psi, double new_psi);

  double decay_;
  int64_t rescale_every_;
  int64_t steps_since_rescale_ = 0;
  double g_ = 1.0;               // Psi = Phi * g
  std::vector<double> psi_;
  // fp32 images of psi_, kept beside it: a dense table's clamp selects over a slice of them in
  // place instead of gathering the non-zero entries and their values every step (that gather
  // was most of SelectAbove at 8B shapes, where random weights fill both tables).
  std::vector<float> psi_f32_;
  std::vector<int64_t> nonzero_index_;  // indices of the non-zero entries, in insertion order
  // SelectAbove's eligible entries, their values and the clamp's picks (no allocation per step).
  mutable std::vector<int64_t> scratch_;
  mutable std::vector<float> scratch_values_;
  mutable std::vector<int32_t> top_;
  mutable std::vector<uint64_t> picked_bits_;  // the clamp's picks, one bit per eligible entry
  // SelectDense's clamp floor (fp32 image of Psi; 0: none yet) and the subset at or above it.
  mutable float clamp_floor_ = 0.0f;
  mutable std::vector<int32_t> floor_index_, slack_top_;
  mutable std::vector<float> floor_values_, slack_values_;
  // SelectDense's pass in chunks of about kChunk entries, one task each.
  static constexpr int64_t kChunk = 32768;
  struct Chunk {
    int64_t above = 0, nonzero = 0, positive = 0;
    std::vector<int32_t> index;  // offsets from lo of the entries at or above the floor
    std::vector<float> values;
  };
  mutable std::vector<Chunk> chunks_;
  int64_t nonzero_ = 0;
  double sum_[5] = {0, 0, 0, 0, 0};  // sum over non-zero entries of Psi^k, k = 1..4
};

// The vertical/slash pair of one KV head.
class LfpsTables {
 public:
  explicit LfpsTables(double decay = 0.95, int64_t rescale_every = 256)
      : vertical_(decay, rescale_every), slash_(decay, rescale_every) {}

  void Step() {
    vertical_.Step();
    slash_.Step();
  }
  // The query at `query_position` gave weight w to the key at `key_position` (<= query_position).
  void Add(int64_t key_position, int64_t query_position, double w) {
    vertical_.Add(key_position, w);
    slash_.Add(query_position - key_position, w);
  }
  // Phi_ver[position] += w / Phi_sla[distance] += w alone (loading captured tables).
  void AddVertical(int64_t position, double w) { vertical_.Add(position, w); }
  void AddSlash(int64_t distance, double w) { slash_.Add(distance, w); }
  const DecayedTable& vertical() const { return vertical_; }
  const DecayedTable& slash() const { return slash_; }

 private:
  DecayedTable vertical_, slash_;
};

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_LFPS_TABLES_H_
