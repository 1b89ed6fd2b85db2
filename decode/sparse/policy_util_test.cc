#include "decode/sparse/policy_util.h"

#include <algorithm>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace fluxion::decode::sparse {
namespace {

TEST(SortUniqueWithinTest, SortsDropsRepeatsAndPositionsOutsideTheRange) {
  std::vector<int32_t> positions = {70, 5, 64, 70, 63, 200, 9, 130, 4, 129, 64};
  std::vector<uint64_t> words;
  SortUniqueWithin(5, 130, &positions, &words);
  EXPECT_EQ(positions, (std::vector<int32_t>{5, 9, 63, 64, 70, 129}));
}

TEST(SortUniqueWithinTest, MatchesSortAndUniqueOnRandomInput) {
  std::mt19937 rng(7);
  std::vector<uint64_t> words = {~uint64_t{0}};  // stale bits from an earlier call must not leak
  for (int trial = 0; trial < 50; ++trial) {
    const int32_t begin = static_cast<int32_t>(rng() % 100);
    const int32_t end = begin + static_cast<int32_t>(rng() % 3000);
    std::vector<int32_t> positions(rng() % 5000);
    for (int32_t& p : positions) p = static_cast<int32_t>(rng() % 3200);
    std::vector<int32_t> want;
    for (int32_t p : positions) {
      if (p >= begin && p < end) want.push_back(p);
    }
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    SortUniqueWithin(begin, end, &positions, &words);
    EXPECT_EQ(positions, want) << "trial " << trial;
  }
}

TEST(SortUniqueWithinTest, EmptyRangeClears) {
  std::vector<int32_t> positions = {1, 2, 3};
  std::vector<uint64_t> words;
  SortUniqueWithin(10, 10, &positions, &words);
  EXPECT_TRUE(positions.empty());
}

}  // namespace
}  // namespace fluxion::decode::sparse
