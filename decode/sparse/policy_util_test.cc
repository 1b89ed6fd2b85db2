#include "decode/sparse/policy_util.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace fluxion::decode::sparse {
namespace {

// Positions, one run each.
std::vector<int32_t> Marked(int64_t begin, int64_t end, const std::vector<int32_t>& positions,
                            std::vector<uint64_t>* words, int64_t run = 1) {
  CandidateMarks marks(begin, end, words);
  for (int32_t p : positions) marks.MarkRun(p, run);
  std::vector<int32_t> out = {-1};  // replaced, not appended to
  marks.ReadOut(&out);
  return out;
}

TEST(CandidateMarksTest, SortsDropsRepeatsAndPositionsOutsideTheRange) {
  std::vector<uint64_t> words;
  EXPECT_EQ(Marked(5, 130, {70, 5, 64, 70, 63, 200, 9, 130, 4, 129, 64}, &words),
            (std::vector<int32_t>{5, 9, 63, 64, 70, 129}));
}

TEST(CandidateMarksTest, MatchesSortAndUniqueOnRandomRuns) {
  std::mt19937 rng(7);
  std::vector<uint64_t> words = {~uint64_t{0}};  // stale bits from an earlier use must not leak
  for (int trial = 0; trial < 60; ++trial) {
    const int32_t begin = static_cast<int32_t>(rng() % 100);
    const int32_t end = begin + static_cast<int32_t>(rng() % 3000);
    const int64_t run = trial % 3 == 0 ? 1 : trial % 3 == 1 ? 4 : 1 + rng() % 130;
    std::vector<int32_t> positions(rng() % 5000);
    for (int32_t& p : positions) p = static_cast<int32_t>(rng() % 3300) - 100;
    std::vector<int32_t> want;
    for (int32_t p : positions) {
      for (int64_t i = p; i < p + run; ++i) {
        if (i >= begin && i < end) want.push_back(static_cast<int32_t>(i));
      }
    }
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    EXPECT_EQ(Marked(begin, end, positions, &words, run), want) << "trial " << trial;
  }
}

TEST(CandidateMarksTest, EmptyRangeHoldsNothing) {
  std::vector<uint64_t> words;
  EXPECT_TRUE(Marked(10, 10, {1, 10, 11}, &words, 4).empty());
  EXPECT_TRUE(Marked(10, 5, {1, 7, 11}, &words, 4).empty());
}

TEST(ThinEvenlyTest, KeepsEvenlySpacedWholeGroupsAndNeverAdds) {
  std::vector<int32_t> p = {10, 11, 12, 13, 20, 21, 22, 23};
  ThinEvenly(4, 1, &p);  // groups of one: indices 0, 2, 4, 6
  EXPECT_EQ(p, (std::vector<int32_t>{10, 12, 20, 22}));
  ThinEvenly(6, 1, &p);  // no more than the target: unchanged
  EXPECT_EQ(p, (std::vector<int32_t>{10, 12, 20, 22}));
  std::vector<int32_t> q;
  for (int32_t i = 0; i < 40; ++i) q.push_back(100 + 3 * i);
  ThinEvenly(12, 4, &q);  // 10 groups of 4, 3 kept: groups 0, 3, 6
  EXPECT_EQ(q, (std::vector<int32_t>{100, 103, 106, 109, 136, 139, 142, 145, 172, 175, 178, 181}));
  std::vector<int32_t> r = {1, 2, 3, 4, 5, 6, 7};
  ThinEvenly(3, 2, &r);  // 4 groups ({1,2} {3,4} {5,6} {7}), 2 kept: groups 0 and 2
  EXPECT_EQ(r, (std::vector<int32_t>{1, 2, 5, 6}));
  ThinEvenly(0, 4, &r);
  EXPECT_TRUE(r.empty());
}

}  // namespace
}  // namespace fluxion::decode::sparse
