#include "decode/sparse/block_bounds.h"

#include <algorithm>
#include <random>
#include <vector>

#include "common/half.h"
#include "gtest/gtest.h"

namespace fluxion::decode::sparse {
namespace {

// The derived 64-token bounds equal the element-wise min/max of the stored (bf16) keys of each
// block, including the trailing block while it fills, across several appends.
TEST(BlockBoundsTest, DerivedBoundsMatchTheKeysOfEachBlockAsTheSequenceGrows) {
  const int64_t d = 8, pt = 16, block = 64;
  const KvShape shape{1, 1, d, pt};
  auto arena = *KvArena::Create(shape.page_bytes(), 64);
  auto kv = *PagedKv::Create(arena.get(), shape);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> all_k;
  BlockBounds bounds(block);
  for (int64_t add : {100, 1, 27, 64, 3}) {
    std::vector<float> k(add * d), v(add * d);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    ASSERT_TRUE(kv->Append(0, add, k.data(), v.data(), d).ok());
    all_k.insert(all_k.end(), k.begin(), k.end());
    bounds.Update(*kv, 0, 0);
    const int64_t n = kv->length(0);
    ASSERT_EQ(bounds.num_blocks(), (n + block - 1) / block);
    for (int64_t b = 0; b < bounds.num_blocks(); ++b) {
      for (int64_t i = 0; i < d; ++i) {
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t t = b * block; t < std::min(n, (b + 1) * block); ++t) {
          const float x = Bf16ToFloat(FloatToBf16(all_k[t * d + i]));
          lo = std::min(lo, x);
          hi = std::max(hi, x);
        }
        EXPECT_EQ(bounds.key_min()[b * d + i], lo) << "block " << b << " dim " << i << " at " << n;
        EXPECT_EQ(bounds.key_max()[b * d + i], hi) << "block " << b << " dim " << i << " at " << n;
      }
    }
  }
}

}  // namespace
}  // namespace fluxion::decode::sparse
