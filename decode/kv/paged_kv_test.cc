#include "decode/kv/paged_kv.h"

#include <cstring>
#include <random>

#include "gtest/gtest.h"

namespace fluxion::decode {
namespace {

constexpr KvShape kShape{2, 2, 32, 16};

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

TEST(PagedKvTest, AppendStoresBf16RowsAcrossPageBoundariesAndTracksMetadata) {
  auto arena = *KvArena::Create(kShape.page_bytes(), 64);
  auto kv = *PagedKv::Create(arena.get(), kShape);
  const int64_t row = kShape.num_kv_heads * kShape.head_dim;
  auto k = Random(40 * row, 1), v = Random(40 * row, 2);
  ASSERT_TRUE(kv->Append(0, 25, k.data(), v.data(), row).ok());
  ASSERT_TRUE(kv->Append(0, 15, k.data() + 25 * row, v.data() + 25 * row, row).ok());
  EXPECT_EQ(kv->length(0), 40);
  EXPECT_EQ(kv->length(1), 0);
  ASSERT_EQ(kv->pages(0, 1).size(), 3u);
  const auto view = kv->view();
  for (int64_t t = 0; t < 40; ++t) {
    for (int h = 0; h < 2; ++h) {
      const bf16* kr = view.keys(kv->pages(0, h)[t / 16]) + (t % 16) * 32;
      const bf16* vr = view.values(kv->pages(0, h)[t / 16]) + (t % 16) * 32;
      for (int j = 0; j < 32; ++j) {
        ASSERT_EQ(kr[j].bits, FloatToBf16(k[t * row + h * 32 + j]).bits);
        ASSERT_EQ(vr[j].bits, FloatToBf16(v[t * row + h * 32 + j]).bits);
      }
    }
  }
  // Page 2 holds tokens 32..39: its min/max are over those rows only.
  for (int j = 0; j < 32; ++j) {
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t t = 32; t < 40; ++t) {
      const float x = RoundToBf16(k[t * row + 32 + j]);
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
    EXPECT_EQ(kv->key_min(0, 1)[2 * 32 + j], lo);
    EXPECT_EQ(kv->key_max(0, 1)[2 * 32 + j], hi);
  }
}

// A prompt written into reserved pages (as a prefill node does) and adopted with ComputeBounds'
// metadata has exactly the metadata of the same prompt appended token by token; Adopt refuses
// bounds of the wrong size.
TEST(PagedKvTest, AdoptedBoundsEqualAppendedOnesAndWrongSizesAreRefused) {
  auto arena = *KvArena::Create(kShape.page_bytes(), 64);
  const int64_t row = kShape.num_kv_heads * kShape.head_dim, tokens = 40, per_head = 3;
  auto k = Random(tokens * row, 5), v = Random(tokens * row, 6);
  auto appended = *PagedKv::Create(arena.get(), kShape);
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(appended->Append(layer, tokens, k.data(), v.data(), row).ok());
  }
  absl::StatusOr<Reservation> held =
      Reservation::Allocate(arena.get(), 2 * 2 * per_head, nullptr);
  ASSERT_TRUE(held.ok()) << held.status();
  std::vector<int32_t> ids;
  for (const PageRun& r : held->runs()) {
    for (int32_t p = r.first; p < r.first + r.count; ++p) ids.push_back(p);
  }
  for (int64_t layer = 0; layer < 2; ++layer) {  // copy the appended pages: same bytes
    for (int h = 0; h < 2; ++h) {
      for (int64_t i = 0; i < per_head; ++i) {
        std::memcpy(arena->page(ids[(layer * 2 + h) * per_head + i]),
                    arena->page(appended->pages(layer, h)[i]), kShape.page_bytes());
      }
    }
  }
  absl::StatusOr<PageBounds> bounds = PagedKv::ComputeBounds(*arena, kShape, ids, tokens);
  ASSERT_TRUE(bounds.ok()) << bounds.status();
  PageBounds short_bounds = *bounds;
  short_bounds.max[3].pop_back();
  absl::StatusOr<Reservation> other = Reservation::Allocate(arena.get(), ids.size(), nullptr);
  std::vector<int32_t> other_ids;
  for (const PageRun& r : other->runs()) {
    for (int32_t p = r.first; p < r.first + r.count; ++p) other_ids.push_back(p);
  }
  EXPECT_EQ(PagedKv::Adopt(std::move(*other), kShape, other_ids, tokens, short_bounds)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<PagedKv>> adopted =
      PagedKv::Adopt(std::move(*held), kShape, ids, tokens, std::move(*bounds));
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  for (int layer = 0; layer < 2; ++layer) {
    for (int h = 0; h < 2; ++h) {
      for (int64_t j = 0; j < per_head * kShape.head_dim; ++j) {
        ASSERT_EQ((*adopted)->key_min(layer, h)[j], appended->key_min(layer, h)[j]);
        ASSERT_EQ((*adopted)->key_max(layer, h)[j], appended->key_max(layer, h)[j]);
      }
    }
  }
  const int64_t free_before = arena->counters().free;
  adopted->reset();
  EXPECT_EQ(arena->counters().free, free_before + 2 * 2 * per_head);
}

TEST(PagedKvTest, ExhaustedArenaAppendsNothingAndDestructionFreesEverything) {
  auto arena = *KvArena::Create(kShape.page_bytes(), 5);
  {
    auto kv = *PagedKv::Create(arena.get(), kShape);
    const int64_t row = kShape.num_kv_heads * kShape.head_dim;
    auto k = Random(64 * row, 3);
    ASSERT_TRUE(kv->Append(0, 32, k.data(), k.data(), row).ok());  // 2 pages x 2 heads
    absl::Status s = kv->Append(1, 32, k.data(), k.data(), row);   // needs 4 more, 1 free
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(kv->length(1), 0);
    EXPECT_EQ(arena->counters().reserved, 4);
  }
  EXPECT_EQ(arena->counters().free, 5);
}

TEST(PagedKvTest, CreateRejectsPagesTooSmallForTheShape) {
  auto arena = *KvArena::Create(1024, 4);
  EXPECT_EQ(PagedKv::Create(arena.get(), kShape).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::decode
