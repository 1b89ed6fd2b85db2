// The paired accuracy difference two decodes of the same samples give, with its interval: shared
// by `fluxion eval tasks` (every policy against the run's first) and `fluxion eval compare`
// (run A against run B, e.g. a policy without and with the error guard).
#ifndef FLUXION_BENCH_EVAL_PAIRED_STATS_H_
#define FLUXION_BENCH_EVAL_PAIRED_STATS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace fluxion::eval {

struct Interval {
  double low = 0, high = 0;
};

// 95% interval of a paired accuracy difference (gained - lost) / n: the Wald interval on the
// discordant pairs, as McNemar's test uses them. {0, 0} for n == 0.
inline Interval PairedDifference95(int64_t lost, int64_t gained, int64_t n) {
  if (n <= 0) return {0.0, 0.0};
  constexpr double z = 1.959963984540054;
  const double nn = static_cast<double>(n);
  const double d = (gained - lost) / nn;
  const double var = ((gained + lost) / nn - d * d) / nn;
  const double half = z * std::sqrt(std::max(var, 0.0));
  return {d - half, d + half};
}

}  // namespace fluxion::eval

#endif  // FLUXION_BENCH_EVAL_PAIRED_STATS_H_
