#include "decode/sparse/granularity.h"

#include <vector>

#include "gtest/gtest.h"

namespace fluxion::decode::sparse {
namespace {

TEST(GranularityTest, CoarserBlocksScanLessMetadataAndCostLessAtLongContexts) {
  const HostCostModel cost;
  // 128K middle rows, k = 2% of them: the metadata scan dominates at 16-token blocks.
  const StepShape shape{131072, 2621, 128, 2};
  const double t16 = PredictStepMicros(cost, shape, 16), t64 = PredictStepMicros(cost, shape, 64);
  EXPECT_GT(t16, t64);
  // At 16 tokens the fp32 bounds are 1/8 of the K+V bytes of the region they describe.
  const double meta16 = 131072.0 / 16 * 2 * 128 * 4, kv = 131072.0 * 2 * 128 * 2;
  EXPECT_DOUBLE_EQ(meta16 / kv, 0.125);
  // Doubling the bandwidth halves the byte terms.
  HostCostModel fast = cost;
  fast.read_gbps *= 2;
  fast.topk_ns_per_score = 0;
  HostCostModel slow = cost;
  slow.topk_ns_per_score = 0;
  EXPECT_NEAR(PredictStepMicros(fast, shape, 32) * 2, PredictStepMicros(slow, shape, 32), 1e-9);
}

TEST(GranularityTest, BlockMassAlignsToAbsolutePositions) {
  // Middle tokens 4..35 (first_position 4): 16-token blocks [0,16) [16,32) [32,48).
  std::vector<double> mass(32, 1.0);
  const std::vector<double> b16 = BlockMass(mass, 4, 16);
  ASSERT_EQ(b16.size(), 3u);
  EXPECT_DOUBLE_EQ(b16[0], 12);
  EXPECT_DOUBLE_EQ(b16[1], 16);
  EXPECT_DOUBLE_EQ(b16[2], 4);
}

TEST(GranularityTest, CoverageOfScatteredMassFallsWithCoarserBlocks) {
  // 8 needles, one per 64-token region, each alone in its 16-token block.
  std::vector<double> mass(512, 0.0);
  for (int i = 0; i < 8; ++i) mass[i * 64 + 5] = 1.0;
  // 128 rows: eight 16-token blocks hold every needle; two 64-token blocks hold two of eight.
  EXPECT_DOUBLE_EQ(BlockCoverage(BlockMass(mass, 0, 16), 16, 128), 1.0);
  EXPECT_DOUBLE_EQ(BlockCoverage(BlockMass(mass, 0, 64), 64, 128), 0.25);
  // No evidence: full coverage.
  EXPECT_DOUBLE_EQ(BlockCoverage(std::vector<double>(8, 0.0), 64, 128), 1.0);
}

TEST(GranularityTest, ChoosesTheCheapestBlockThatKeepsCoverage) {
  const HostCostModel cost;
  const StepShape shape{131072, 2621, 128, 2};
  // Coverage equal at every size: the cheapest (64) wins.
  EXPECT_EQ(ChooseGranularity(cost, shape, {0.9, 0.9, 0.9}, 0.02).block, 64);
  // 64 loses too much coverage: 32.
  EXPECT_EQ(ChooseGranularity(cost, shape, {0.9, 0.89, 0.5}, 0.02).block, 32);
  // Only 16 keeps it.
  const GranularityChoice c = ChooseGranularity(cost, shape, {0.9, 0.6, 0.5}, 0.02);
  EXPECT_EQ(c.block, 16);
  EXPECT_DOUBLE_EQ(c.coverage, 0.9);
  EXPECT_DOUBLE_EQ(c.predicted_us, PredictStepMicros(cost, shape, 16));
}

}  // namespace
}  // namespace fluxion::decode::sparse
