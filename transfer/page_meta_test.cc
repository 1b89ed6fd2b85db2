// The per-page metadata wire format (transfer/page_meta.h): encoded from packed pages it holds
// the exact bf16 bounds of each page's valid rows, decodes to the same fp32 values, and a block
// with a non-finite or inverted bound is refused.
#include "transfer/page_meta.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "common/half.h"
#include "gtest/gtest.h"

namespace fluxion::transfer {
namespace {

// 3 heads, head_dim 16, 4 tokens per page; a 10-token prompt: 3 pages per head, the last with
// 2 valid rows (the zero tail must not count as keys).
const KvPageGeometry kGeo{1, 3, 16, 4};
constexpr int64_t kTokens = 10;

struct Packed {
  std::vector<float> k, v;
  std::vector<uint8_t> pages;
};

// Keys that are all negative, so a zero row counted by mistake would show up as a max of 0.
Packed MakePages() {
  Packed p;
  const int64_t row = kGeo.num_kv_heads * kGeo.head_dim;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-5.0f, -0.5f);
  p.k.resize(kTokens * row);
  p.v.resize(kTokens * row);
  for (float& x : p.k) x = u(rng);
  for (float& x : p.v) x = u(rng);
  p.pages.resize(kGeo.pages_per_layer(kTokens) * kGeo.content_bytes());
  PackLayerPages(kGeo, kTokens, p.k.data(), p.v.data(), row, p.pages.data());
  return p;
}

TEST(PageMetaTest, SizesFollowTheGeometry) {
  const KvPageGeometry g{32, 8, 128, 16};
  EXPECT_EQ(PageMetaRecordBytes(g), 512u);
  EXPECT_EQ(PageMetaLayerBytes(g, 17), 8u * 2 * 512);
  EXPECT_EQ(PageMetaBytes(g, 17), 32u * 8 * 2 * 512);
  // 1/16 of the KV content at 16-token pages of head_dim 128.
  EXPECT_EQ(PageMetaBytes(g, 4096) * 16, static_cast<uint64_t>(g.total_pages(4096)) *
                                             g.content_bytes());
}

TEST(PageMetaTest, BlockHoldsTheExactBoundsOfEachPagesValidRows) {
  const Packed p = MakePages();
  std::vector<uint8_t> block(PageMetaLayerBytes(kGeo, kTokens));
  EncodeLayerPageMeta(kGeo, kTokens, p.pages.data(), block.data());
  const int64_t d = kGeo.head_dim, row = kGeo.num_kv_heads * d, per_head = 3;
  for (int64_t h = 0; h < kGeo.num_kv_heads; ++h) {
    for (int64_t i = 0; i < per_head; ++i) {
      const auto* rec =
          reinterpret_cast<const bf16*>(block.data() + (h * per_head + i) * PageMetaRecordBytes(kGeo));
      for (int64_t t = 0; t < d; ++t) {
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t tok = i * 4; tok < std::min<int64_t>((i + 1) * 4, kTokens); ++tok) {
          const float kr = RoundToBf16(p.k[tok * row + h * d + t]);
          lo = std::min(lo, kr);
          hi = std::max(hi, kr);
        }
        EXPECT_EQ(Bf16ToFloat(rec[t]), lo) << h << " " << i << " " << t;
        EXPECT_EQ(Bf16ToFloat(rec[d + t]), hi) << h << " " << i << " " << t;
        EXPECT_LT(hi, 0.0f);  // the zero tail of the last page was not counted
      }
    }
  }
}

TEST(PageMetaTest, EncodingRangeByRangeEqualsTheWholeLayer) {
  const Packed p = MakePages();
  std::vector<uint8_t> whole(PageMetaLayerBytes(kGeo, kTokens)), pieces(whole.size(), 0xab);
  EncodeLayerPageMeta(kGeo, kTokens, p.pages.data(), whole.data());
  EncodePageMetaRange(kGeo, kTokens, p.pages.data(), 0, 1, pieces.data());
  EXPECT_NE(pieces, whole);  // pages 1 and 2 of every head are not written yet
  EncodePageMetaRange(kGeo, kTokens, p.pages.data(), 1, 3, pieces.data());
  EXPECT_EQ(pieces, whole);
}

TEST(PageMetaTest, EncodingPackedRangesEqualsTheWholeLayer) {
  const Packed p = MakePages();
  std::vector<uint8_t> whole(PageMetaLayerBytes(kGeo, kTokens)), pieces(whole.size(), 0xab);
  EncodeLayerPageMeta(kGeo, kTokens, p.pages.data(), whole.data());
  const int64_t per_head = kGeo.pages_per_head(kTokens);
  const size_t cb = kGeo.content_bytes();
  for (auto [p0, p1] : {std::pair<int64_t, int64_t>{0, 1}, {1, 3}}) {
    std::vector<uint8_t> packed;  // pages [p0, p1) of each head, head after head
    for (int64_t h = 0; h < kGeo.num_kv_heads; ++h) {
      const uint8_t* from = p.pages.data() + (h * per_head + p0) * cb;
      packed.insert(packed.end(), from, from + (p1 - p0) * cb);
    }
    EncodePackedPageMeta(kGeo, kTokens, packed.data(), p0, p1, pieces.data());
  }
  EXPECT_EQ(pieces, whole);
}

TEST(PageMetaTest, DecodeGivesWhatPageKeyBoundsComputesFromThePages) {
  const Packed p = MakePages();
  std::vector<uint8_t> block(PageMetaLayerBytes(kGeo, kTokens));
  EncodeLayerPageMeta(kGeo, kTokens, p.pages.data(), block.data());
  const int64_t d = kGeo.head_dim, per_head = 3;
  std::vector<std::vector<float>> mn(3, std::vector<float>(per_head * d)), mx = mn;
  std::vector<float*> mins = {mn[0].data(), mn[1].data(), mn[2].data()};
  std::vector<float*> maxs = {mx[0].data(), mx[1].data(), mx[2].data()};
  ASSERT_TRUE(DecodeLayerPageMeta(kGeo, kTokens, block.data(), mins, maxs).ok());
  std::vector<float> lo(d), hi(d);
  for (int64_t h = 0; h < 3; ++h) {
    for (int64_t i = 0; i < per_head; ++i) {
      const auto* keys =
          reinterpret_cast<const bf16*>(p.pages.data() + (h * per_head + i) * kGeo.content_bytes());
      PageKeyBounds(d, std::min<int64_t>(4, kTokens - i * 4), keys, lo.data(), hi.data());
      for (int64_t t = 0; t < d; ++t) {
        EXPECT_EQ(mn[h][i * d + t], lo[t]);
        EXPECT_EQ(mx[h][i * d + t], hi[t]);
      }
    }
  }
}

// The vector fold gives the bits of the plain std::min / std::max fold, signed zeros and NaNs
// included (head_dim 24: three 8-wide chunks; 5 rows).
TEST(PageMetaTest, PageKeyBoundsIsTheOrderedScalarFoldBitForBit) {
  constexpr int64_t d = 24, rows = 5;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<bf16> keys(rows * d);
  for (bf16& k : keys) k = FloatToBf16(u(rng));
  const uint16_t specials[] = {0x0000, 0x8000, 0x7fc0, 0x7f80, 0xff80, 0x0001};
  for (size_t i = 0; i < keys.size(); i += 3) keys[i].bits = specials[(i / 3) % 6];
  std::vector<float> mn(d), mx(d);
  PageKeyBounds(d, rows, keys.data(), mn.data(), mx.data());
  for (int64_t t = 0; t < d; ++t) {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (int64_t r = 0; r < rows; ++r) {
      lo = std::min(lo, Bf16ToFloat(keys[r * d + t]));
      hi = std::max(hi, Bf16ToFloat(keys[r * d + t]));
    }
    uint32_t a, b;
    std::memcpy(&a, &mn[t], 4);
    std::memcpy(&b, &lo, 4);
    EXPECT_EQ(a, b) << "min " << t;
    std::memcpy(&a, &mx[t], 4);
    std::memcpy(&b, &hi, 4);
    EXPECT_EQ(a, b) << "max " << t;
  }
}

TEST(PageMetaTest, NonFiniteOrInvertedBoundsAreRefused) {
  const Packed p = MakePages();
  std::vector<uint8_t> good(PageMetaLayerBytes(kGeo, kTokens));
  EncodeLayerPageMeta(kGeo, kTokens, p.pages.data(), good.data());
  const int64_t d = kGeo.head_dim, per_head = 3;
  std::vector<float> out(3 * per_head * d * 2);
  std::vector<float*> mins, maxs;
  for (int h = 0; h < 3; ++h) {
    mins.push_back(out.data() + h * per_head * d);
    maxs.push_back(out.data() + (3 + h) * per_head * d);
  }
  const size_t at = (1 * per_head + 2) * PageMetaRecordBytes(kGeo) + 2 * 5;  // head 1, page 2, min[5]
  for (const uint16_t bad : {uint16_t{0x7fc0} /* NaN */, uint16_t{0x7f80} /* +inf */,
                             uint16_t{0xff80} /* -inf */, uint16_t{0x4200} /* 32 > max */}) {
    std::vector<uint8_t> block = good;
    std::memcpy(block.data() + at, &bad, 2);
    const absl::Status s = DecodeLayerPageMeta(kGeo, kTokens, block.data(), mins, maxs);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("KV head 1, page 2, element 5"), absl::string_view::npos)
        << s.message();
  }
}

}  // namespace
}  // namespace fluxion::transfer
