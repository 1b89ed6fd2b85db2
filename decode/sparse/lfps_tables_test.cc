#include "decode/sparse/lfps_tables.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"

namespace fluxion::decode::sparse {
namespace {

// The definition, applied literally: decay every entry every step.
struct EagerTable {
  std::vector<double> phi;
  void Step() {
    for (double& p : phi) p *= 0.95;
  }
  void Add(int64_t i, double w) {
    if (i >= static_cast<int64_t>(phi.size())) phi.resize(i + 1, 0.0);
    phi[i] += w;
  }
};

TEST(DecayedTableTest, LazyDecayMatchesEagerDecayOverThousandsOfSteps) {
  // 3000 steps: far past where fp32 lazy sums overflow, across many rescales.
  DecayedTable lazy(0.95, 256);
  EagerTable eager;
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> u(0, 1);
  for (int step = 0; step < 3000; ++step) {
    lazy.Step();
    eager.Step();
    for (int k = 0; k < 5; ++k) {
      const int64_t i = rng() % 200;
      const double w = u(rng);
      lazy.Add(i, w);
      eager.Add(i, w);
    }
  }
  for (int64_t i = 0; i < 200; ++i) {
    const double want = i < static_cast<int64_t>(eager.phi.size()) ? eager.phi[i] : 0.0;
    EXPECT_NEAR(lazy.value(i), want, 1e-9 * std::max(1.0, want)) << i;
  }
}

TEST(DecayedTableTest, MomentsMatchADirectComputationBetweenRescales) {
  DecayedTable t(0.95, 256);
  std::mt19937 rng(2);
  std::exponential_distribution<double> e(1.0);
  for (int step = 0; step < 300; ++step) {  // crosses one rescale
    t.Step();
    t.Add(rng() % 500, e(rng));
  }
  std::vector<double> v;
  for (int64_t i = 0; i < t.size(); ++i)
    if (t.value(i) != 0) v.push_back(t.value(i));
  double mean = 0;
  for (double x : v) mean += x / v.size();
  double m2 = 0, m4 = 0;
  for (double x : v) {
    m2 += (x - mean) * (x - mean) / v.size();
    m4 += std::pow(x - mean, 4) / v.size();
  }
  const TableMoments m = t.moments();
  EXPECT_EQ(m.count, static_cast<int64_t>(v.size()));
  EXPECT_NEAR(m.mean, mean, 1e-9 * mean);
  EXPECT_NEAR(m.stddev, std::sqrt(m2), 1e-6 * std::sqrt(m2));
  EXPECT_NEAR(m.kurtosis, m4 / (m2 * m2), 1e-4 * m4 / (m2 * m2));
}

TEST(DecayedTableTest, SelectAboveFindsThePeaksAndHonoursTheClamps) {
  DecayedTable t(0.95, 256);
  t.Step();
  for (int64_t i = 0; i < 100; ++i) t.Add(i, 0.01);  // flat background
  t.Add(17, 5.0);                                     // two peaks
  t.Add(63, 4.0);
  std::vector<int64_t> out;
  t.SelectAbove(0.2, 0, 50, &out);
  EXPECT_EQ(out, (std::vector<int64_t>{17, 63}));
  out.clear();
  t.SelectAbove(0.2, 5, 50, &out);  // at least five: the peaks plus three background entries
  EXPECT_EQ(out.size(), 5u);
  EXPECT_NE(std::find(out.begin(), out.end(), 17), out.end());
  out.clear();
  t.SelectAbove(-10.0, 0, 10, &out);  // everything qualifies: clamped to the 10 largest
  EXPECT_EQ(out.size(), 10u);
  EXPECT_NE(std::find(out.begin(), out.end(), 63), out.end());
}

// The local window's entries are the heaviest (attended every step); a range that excludes them
// must still yield `min_count` entries from the rest, peaks first.
TEST(DecayedTableTest, SelectAboveInARangeSpendsTheClampsInsideIt) {
  DecayedTable t(0.95, 256);
  t.Step();
  for (int64_t i = 0; i < 200; ++i) t.Add(i, 0.01);     // background
  for (int64_t i = 180; i < 200; ++i) t.Add(i, 10.0);   // "window": the heaviest entries
  t.Add(40, 2.0);                                       // a needle in the middle
  std::vector<int64_t> out;
  t.SelectAbove(0.2, 5, 50, &out);  // unrestricted: the 20 window entries, no needle
  EXPECT_EQ(out.size(), 20u);
  for (int64_t i : out) EXPECT_GE(i, 180);
  out.clear();
  t.SelectAbove(0.2, 5, 50, 4, 180, &out);  // the middle only: the needle plus four others
  ASSERT_EQ(out.size(), 5u);
  EXPECT_NE(std::find(out.begin(), out.end(), 40), out.end());
  for (int64_t i : out) {
    EXPECT_GE(i, 4);
    EXPECT_LT(i, 180);
  }
  out.clear();
  t.SelectAbove(0.2, 5, 50, 300, 400, &out);  // an empty range selects nothing
  EXPECT_TRUE(out.empty());
}

// SelectAbove by its definition, over a table whose g is 1 (Psi = Phi, value() exact) and whose
// entries were inserted in index order (so "earlier" ties and "lower index" ties agree): the
// entries of [lo, hi) at or above the threshold, or, when their count breaks a clamp, the k
// largest by fp32 value, ties to the lower index; ascending.
std::vector<int64_t> SelectByDefinition(const DecayedTable& t, double a, int64_t min_count,
                                        int64_t max_count, int64_t lo, int64_t hi) {
  const TableMoments m = t.moments();
  const double threshold = m.mean + a * std::sqrt(m.kurtosis) * m.stddev;
  std::vector<int64_t> eligible, above;
  for (int64_t i = std::max<int64_t>(lo, 0); i < std::min(hi, t.size()); ++i) {
    if (t.value(i) == 0.0) continue;
    eligible.push_back(i);
    if (t.value(i) >= threshold) above.push_back(i);
  }
  const int64_t n = static_cast<int64_t>(eligible.size());
  const int64_t want_min = std::min(min_count, n);
  const int64_t count = static_cast<int64_t>(above.size());
  if (count <= max_count && count >= want_min) return above;
  const int64_t k = count > max_count ? max_count : want_min;
  std::stable_sort(eligible.begin(), eligible.end(), [&](int64_t x, int64_t y) {
    return static_cast<float>(t.value(x)) > static_cast<float>(t.value(y));
  });
  eligible.resize(k);
  std::sort(eligible.begin(), eligible.end());
  return eligible;
}

// Large tables (dense and sparse walks, many fp32 ties, both clamps) against the definition: the
// radix-select clamp and the bitmap ordering may only save work, never change a pick.
TEST(DecayedTableTest, SelectAboveMatchesItsDefinitionOnLargeTables) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 24; ++trial) {
    DecayedTable t(0.95, /*rescale_every=*/1);
    const int64_t size = 20000 + static_cast<int64_t>(rng() % 20000);
    const double fill = trial % 3 == 0 ? 0.1 : trial % 3 == 1 ? 0.6 : 1.0;
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    for (int64_t i = 0; i < size; ++i) {
      if (unit(rng) >= fill) continue;
      // Half the trials draw from 16 levels only: fp32 ties at every clamp boundary.
      const double w = trial % 2 == 0 ? (1 + rng() % 16) * 1e-3 : std::exp(6 * unit(rng)) * 1e-4;
      t.Add(i, w);
    }
    t.Step();  // rescales (rescale_every 1): g is 1 from here
    const int64_t lo = static_cast<int64_t>(rng() % 2000), hi = size - rng() % 2000;
    const int64_t k_small = 100 + rng() % 400, k_large = 3000 + rng() % 4000;
    struct Case {
      double a;
      int64_t min_count, max_count;
    };
    for (const Case& c : {Case{-10.0, 0, k_large}, Case{-10.0, 0, k_small},
                          Case{0.2, k_large, 1 << 30}, Case{5.0, k_small, 1 << 30},
                          Case{0.2, 0, 1 << 30}}) {
      std::vector<int64_t> got;
      t.SelectAbove(c.a, c.min_count, c.max_count, lo, hi, &got);
      EXPECT_EQ(got, SelectByDefinition(t, c.a, c.min_count, c.max_count, lo, hi))
          << "trial " << trial << " a " << c.a << " min " << c.min_count << " max "
          << c.max_count;
    }
  }
}

// Selections step after step, as a decode runs them: additions between steps, a cap that grows
// with the context, a range whose end moves, and a rescale on the way (the clamp keeps a floor
// from step to step; every step must still pick what the definition picks).
TEST(DecayedTableTest, SelectAboveStaysExactAcrossStepsAndRescales) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  DecayedTable t(0.95, /*rescale_every=*/64);
  const int64_t start = 6000;
  for (int64_t i = 0; i < start; ++i) t.Add(i, std::exp(4 * unit(rng)) * 1e-4);
  for (int64_t step = 0; step < 150; ++step) {
    t.Step();
    const int64_t context = start + step;
    // A step's attended rows: a few hundred additions anywhere, some at fp32 ties.
    for (int j = 0; j < 300; ++j) {
      const int64_t i = static_cast<int64_t>(rng() % context);
      t.Add(i, j % 3 == 0 ? 2e-3 : std::exp(5 * unit(rng)) * 1e-4);
    }
    t.Add(context, 1e-3);
    const int64_t cap = context / 10, floor_count = 2 * (50 + step % 7);
    for (const double a : {-10.0, 0.2}) {  // -10: every entry qualifies, the cap binds
      std::vector<int64_t> got;
      t.SelectAbove(a, floor_count, cap, 2, context - 60, &got);
      ASSERT_EQ(got, SelectByDefinition(t, a, floor_count, cap, 2, context - 60))
          << "step " << step << " a " << a;
    }
  }
}

// A threshold that falls between fp64 values sharing one fp32 image: the count that decides the
// clamp goes by the fp64 values, as the definition does (an fp32-only pass would get it wrong).
TEST(DecayedTableTest, SelectAboveDecidesThresholdTiesInFp64) {
  DecayedTable t(0.95, /*rescale_every=*/1);
  const double x0 = 2e-3;
  for (int64_t i = 0; i < 3000; ++i) {
    // Mostly 1e-3; every tenth entry x0 (1 + j 1e-9), j = 0..3: four fp64 values, one fp32 image.
    t.Add(i, i % 10 == 0 ? x0 * (1 + static_cast<double>(i / 10 % 4) * 1e-9) : 1e-3);
  }
  t.Step();
  ASSERT_EQ(static_cast<float>(t.value(0)), static_cast<float>(t.value(30)));
  const TableMoments m = t.moments();
  for (const double between : {0.5, 1.5, 2.5}) {
    const double threshold = t.value(0) * (1 + between * 1e-9);  // the step decayed x0
    const double a = (threshold - m.mean) / (std::sqrt(m.kurtosis) * m.stddev);
    std::vector<int64_t> got;
    // A cap between the counts: the clamp runs or not by the exact count.
    t.SelectAbove(a, 0, 100, 5, 2990, &got);
    EXPECT_EQ(got, SelectByDefinition(t, a, 0, 100, 5, 2990)) << between;
    EXPECT_GT(got.size(), 0u);
    EXPECT_LT(got.size(), 300u);  // only some of the tied image's entries pass
  }
}

// A dense table whose smallest entries have fp32 images of 0 (far below fp32's range): a clamp
// that must reach into them still picks by the fp64 values' definition.
TEST(DecayedTableTest, SelectAboveReachesEntriesBelowFp32Range) {
  DecayedTable t(0.95, /*rescale_every=*/1);
  for (int64_t i = 0; i < 4000; ++i) {
    if (i % 3 == 1) continue;  // true zeros between them
    t.Add(i, i % 5 == 0 ? 1e-300 * (1 + i % 7) : 1e-3 * (1 + i % 9));
  }
  t.Step();
  for (const int64_t min_count : {int64_t{100}, int64_t{2200}, int64_t{2600}, int64_t{5000}}) {
    std::vector<int64_t> got;
    t.SelectAbove(50.0, min_count, 1 << 30, 10, 3990, &got);
    EXPECT_EQ(got, SelectByDefinition(t, 50.0, min_count, 1 << 30, 10, 3990)) << min_count;
  }
}

TEST(LfpsTablesTest, SlashTableIndexesByDistanceBack) {
  LfpsTables t;
  t.Step();
  t.Add(90, 100, 1.0);  // distance 10
  t.Step();
  t.Add(91, 101, 1.0);  // a copy head: the same distance one step later
  EXPECT_NEAR(t.slash().value(10), 0.95 + 1.0, 1e-12);
  EXPECT_NEAR(t.vertical().value(90), 0.95, 1e-12);
  EXPECT_NEAR(t.vertical().value(91), 1.0, 1e-12);
}

}  // namespace
}  // namespace fluxion::decode::sparse
