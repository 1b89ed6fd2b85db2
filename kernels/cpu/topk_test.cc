#include "kernels/cpu/topk.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_pool.h"

namespace fluxion::kernels::cpu {
namespace {

// The reference: full sort by (score descending, index ascending), first k.
std::vector<int32_t> SortedTopK(const std::vector<float>& s, int64_t k) {
  std::vector<int32_t> idx(s.size());
  for (size_t i = 0; i < s.size(); ++i) idx[i] = static_cast<int32_t>(i);
  auto key = [&](int32_t i) { return std::isnan(s[i]) ? -INFINITY : s[i]; };
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return key(a) > key(b); });
  idx.resize(std::min<int64_t>(k, s.size()));
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::vector<int32_t> Sorted(std::vector<int32_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

TEST(TopKTest, RadixAndNthElementMatchAFullSortOnRandomScores) {
  std::mt19937 rng(3);
  for (int64_t n : {1, 7, 100, 2048, 8192, 40000}) {
    std::normal_distribution<float> normal(0, 3);
    std::vector<float> s(n);
    for (float& x : s) x = normal(rng);
    for (int64_t k : {int64_t{1}, n / 20 + 1, n / 2, n}) {
      std::vector<int32_t> radix, nth;
      TopKIndices(s.data(), n, k, &radix);
      TopKIndicesNthElement(s.data(), n, k, &nth);
      const auto want = SortedTopK(s, k);
      EXPECT_EQ(Sorted(radix), want) << "n=" << n << " k=" << k;
      EXPECT_EQ(Sorted(nth), want) << "n=" << n << " k=" << k;
    }
  }
}

// The task version returns TopKIndices' vector (order included) on every kind of input: wide
// and narrow ranges, many ties, NaN, all equal; run from a ParallelFor task as a decode step
// runs it, in chunks small enough that there are many.
TEST(TopKTest, InTasksReturnsWhatTheOneWalkReturns) {
  std::mt19937 rng(9);
  const CpuPool pool(3);
  for (int trial = 0; trial < 80; ++trial) {
    const int64_t n = 1 + rng() % 20000;
    std::vector<float> s(n);
    const int kind = trial % 4;
    std::normal_distribution<float> normal(0, 3);
    for (float& x : s) {
      x = kind == 0   ? normal(rng)
          : kind == 1 ? 1000.0f + 1e-4f * static_cast<float>(rng() % 50)  // narrow, tied
          : kind == 2 ? (rng() % 7 == 0 ? NAN : static_cast<float>(rng() % 5))
                      : 2.5f;  // all equal
    }
    const int64_t k = static_cast<int64_t>(rng() % (n + 2));
    const int64_t chunk = 1 + rng() % 3000;
    std::vector<int32_t> want, got = {-1};
    TopKIndices(s.data(), n, k, &want);
    // Two items: a ParallelFor of one runs on the caller, outside any parallel region.
    pool.ParallelFor(2, [&](int64_t i) {
      if (i == 0) TopKIndicesInTasks(s.data(), n, k, &got, chunk);
    });
    EXPECT_EQ(got, want) << "trial " << trial << " n=" << n << " k=" << k << " chunk=" << chunk;
    EXPECT_EQ(Sorted(got), SortedTopK(s, k)) << "trial " << trial;
  }
}

TEST(TopKTest, TiesAtTheThresholdTakeLowerIndicesAndExactlyK) {
  std::vector<float> s = {1, 5, 3, 3, 3, 3, -2, 5};
  std::vector<int32_t> out;
  TopKIndices(s.data(), s.size(), 4, &out);
  EXPECT_EQ(Sorted(out), (std::vector<int32_t>{1, 2, 3, 7}));
}

TEST(TopKTest, NegativeZeroInfinityAndNanAreOrdered) {
  std::vector<float> s = {-0.0f, 0.0f, -INFINITY, INFINITY, NAN, -1e-30f, 1e-30f};
  std::vector<int32_t> out;
  TopKIndices(s.data(), s.size(), 3, &out);
  EXPECT_EQ(Sorted(out), (std::vector<int32_t>{1, 3, 6}));
  TopKIndices(s.data(), s.size(), 6, &out);
  EXPECT_EQ(std::count(out.begin(), out.end(), 4), 0);  // NaN is last
}

TEST(TopKTest, KOfZeroOrAboveNIsClamped) {
  std::vector<float> s = {1, 2, 3};
  std::vector<int32_t> out;
  TopKIndices(s.data(), 3, 0, &out);
  EXPECT_TRUE(out.empty());
  TopKIndices(s.data(), 3, 10, &out);
  EXPECT_EQ(Sorted(out), (std::vector<int32_t>{0, 1, 2}));
}

}  // namespace
}  // namespace fluxion::kernels::cpu
