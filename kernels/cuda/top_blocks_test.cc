// TopBlocks (the device's block ranking) against kernels::cpu::TopKIndices on the same scores:
// the picks must be identical, on scores built to stress a radix select (one value everywhere,
// ties at the threshold, a narrow range that differs in the last mantissa bits, NaN and
// infinities), for ranges that start past 0, end past the row's blocks, and want all or more.
#include "kernels/cuda/top_blocks.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/topk.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device_buffers_testing.h"

namespace fluxion::kernels::cuda {
namespace {

// The CPU's picks among scores [first, end), as block numbers, ascending.
std::vector<int32_t> CpuPicks(const float* head, int64_t first, int64_t end, int64_t want) {
  std::vector<int32_t> picked;
  cpu::TopKIndices(head + first, end - first, want, &picked);
  for (int32_t& b : picked) b += static_cast<int32_t>(first);
  std::sort(picked.begin(), picked.end());
  return picked;
}

enum class Fill { kSpread, kNarrow, kConstant, kFewValues, kSpecials };

std::vector<float> Scores(Fill fill, int64_t n, std::mt19937* rng) {
  std::vector<float> s(n);
  std::normal_distribution<float> normal(0.0f, 10.0f);
  for (int64_t j = 0; j < n; ++j) {
    switch (fill) {
      case Fill::kSpread:
        s[j] = normal(*rng);
        break;
      case Fill::kNarrow: {  // 180 plus a few ulps: one exponent, low mantissa bits only
        uint32_t u;
        const float base = 180.0f;
        std::memcpy(&u, &base, sizeof(u));
        u += (*rng)() % 5000;
        std::memcpy(&s[j], &u, sizeof(u));
        break;
      }
      case Fill::kConstant:
        s[j] = 3.5f;
        break;
      case Fill::kFewValues:  // many ties at every threshold
        s[j] = static_cast<float>((*rng)() % 4);
        break;
      case Fill::kSpecials: {
        const float pick[] = {NAN, INFINITY, -INFINITY, -0.0f, 0.0f, 1.0f, -1.0f, 1e-30f};
        s[j] = pick[(*rng)() % 8];
        break;
      }
    }
  }
  return s;
}

TEST(TopBlocksTest, PicksWhatTheCpuSelectionPicks) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  constexpr int64_t kHeads = 3;
  // Rows: (context tokens, block tokens, first, end, want). nb = ceil(context / block).
  struct Row {
    int64_t context, block, first, end, want;
  };
  const std::vector<Row> rows = {
      {131072, 32, 0, 4096, 204},  // 4,096 blocks, 5%
      {131072, 16, 1, 8188, 409},  // 8,192 blocks, a middle range
      {5000, 16, 2, 1000, 7},      // end past nb = 313: clamped
      {640, 32, 1, 20, 19},        // want == n
      {640, 32, 1, 20, 50},        // want > n
      {300, 16, 0, 19, 1},         // one pick
      {300, 16, 0, 19, 0},         // not ranked
  };
  for (Fill fill : {Fill::kSpread, Fill::kNarrow, Fill::kConstant, Fill::kFewValues,
                    Fill::kSpecials}) {
    std::vector<int32_t> block_tokens;
    std::vector<int64_t> positions, offsets, top_offsets;
    std::vector<TopBlocksRange> ranges;
    std::vector<float> scores;
    int64_t picks = 0;
    for (const Row& r : rows) {
      const int64_t nb = (r.context + r.block - 1) / r.block;
      const int64_t end = std::min(r.end, nb);  // the caller clamps (top_blocks.h)
      const int64_t want = std::min(r.want, end - r.first);
      block_tokens.push_back(static_cast<int32_t>(r.block));
      positions.push_back(r.context - 1);
      offsets.push_back(static_cast<int64_t>(scores.size()));
      ranges.push_back({r.first, end, want});
      top_offsets.push_back(picks);
      picks += kHeads * std::max<int64_t>(want, 0);
      const std::vector<float> s = Scores(fill, kHeads * nb, &rng);
      scores.insert(scores.end(), s.begin(), s.end());
    }
    DeviceBuffers dev;
    int32_t* top = dev.ToDevice(std::vector<int32_t>(picks + 1, -7));
    ASSERT_EQ(TopBlocks(dev.ToDevice(scores), dev.ToDevice(block_tokens), dev.ToDevice(positions),
                        dev.ToDevice(offsets), dev.ToDevice(ranges), dev.ToDevice(top_offsets),
                        static_cast<int64_t>(rows.size()), kHeads, top, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> got = DeviceBuffers::ToHost(top, picks + 1);
    for (size_t i = 0; i < rows.size(); ++i) {
      const TopBlocksRange& r = ranges[i];
      const int64_t nb = (rows[i].context + rows[i].block - 1) / rows[i].block;
      if (r.want <= 0) continue;
      for (int64_t h = 0; h < kHeads; ++h) {
        const int64_t at = top_offsets[i] + h * r.want;
        const std::vector<int32_t> gpu(got.begin() + at, got.begin() + at + r.want);
        EXPECT_EQ(gpu, CpuPicks(scores.data() + offsets[i] + h * nb, r.first, r.end, r.want))
            << "fill " << static_cast<int>(fill) << " row " << i << " head " << h;
      }
    }
    EXPECT_EQ(got[picks], -7) << "nothing written past the picks";
  }
}

}  // namespace
}  // namespace fluxion::kernels::cuda
