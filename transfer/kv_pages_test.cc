#include "transfer/kv_pages.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "common/half.h"
#include "gtest/gtest.h"
#include "transfer/crc32c.h"

namespace fluxion::transfer {
namespace {

TEST(Crc32cTest, KnownVectorsAndExtension) {
  // RFC 3720 B.4 test vectors.
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  const char* s = "123456789";
  EXPECT_EQ(Crc32c(s, 9), 0xE3069283u);
  EXPECT_EQ(Crc32cExtend(Crc32c(s, 4), s + 4, 5), Crc32c(s, 9));
}

// Bit by bit, straight from the definition (reflected Castagnoli polynomial, inverted in and out).
uint32_t Crc32cBitwise(uint32_t crc, const uint8_t* p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}

// Many lengths (the 8-byte steps and their byte tail, an 8 KiB page), from odd offsets and with a
// running start value: the hardware path gives the definition's value.
TEST(Crc32cTest, CombineEqualsTheCrcOfTheConcatenation) {
  std::vector<uint8_t> data(70000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + (i >> 7));
  const uint32_t whole = Crc32c(data.data(), data.size());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{69999}, size_t{70000}}) {
    const uint32_t a = Crc32c(data.data(), cut);
    const uint32_t b = Crc32c(data.data() + cut, data.size() - cut);
    EXPECT_EQ(Crc32cCombine(a, b, data.size() - cut), whole) << "cut at " << cut;
  }
  // Three pieces, combined left to right.
  const uint32_t ab = Crc32cCombine(Crc32c(data.data(), 100), Crc32c(data.data() + 100, 900), 900);
  EXPECT_EQ(Crc32cCombine(ab, Crc32c(data.data() + 1000, 69000), 69000), whole);
}

TEST(Crc32cTest, EqualsTheBitwiseDefinition) {
  std::vector<uint8_t> data(40000);
  uint32_t x = 12345;
  for (uint8_t& b : data) b = static_cast<uint8_t>((x = x * 1103515245u + 12345u) >> 24);
  for (const size_t n : {0, 7, 8, 767, 768, 769, 1536, 6143, 6144, 6145, 6912, 8192, 8199,
                         12288, 20000, 39990}) {
    for (const size_t offset : {0, 3}) {
      const uint32_t start = static_cast<uint32_t>(n * 2654435761u);
      EXPECT_EQ(Crc32cExtend(start, data.data() + offset, n),
                Crc32cBitwise(start, data.data() + offset, n))
          << n << " bytes at offset " << offset;
    }
  }
}

TEST(ExpandPageRunsTest, ConcatenatesAndChecks) {
  std::vector<PageIdRun> runs = {{10, 3}, {2, 2}};
  auto ids = ExpandPageRuns(runs, 5, 100);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<uint64_t>{10, 11, 12, 2, 3}));
  EXPECT_EQ(ExpandPageRuns(runs, 6, 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandPageRuns(runs, 4, 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandPageRuns(runs, 5, 12).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<PageIdRun> empty_run = {{0, 0}};
  EXPECT_EQ(ExpandPageRuns(empty_run, 0, 10).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<PageIdRun> wrap = {{~0ull - 1, 4}};
  EXPECT_EQ(ExpandPageRuns(wrap, 4, 100).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PackLayerPagesTest, HeadMajorPagesWithZeroTail) {
  KvPageGeometry g{1, 2, 4, 2};  // 2 heads, head_dim 4, 2 tokens per page
  const int64_t tokens = 3;      // 2 pages per head, the last half full
  std::vector<float> k(tokens * 2 * 4), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i);
    v[i] = -static_cast<float>(i);
  }
  std::vector<uint8_t> dst(g.pages_per_layer(tokens) * g.content_bytes(), 0xAB);
  PackLayerPages(g, tokens, k.data(), v.data(), 8, dst.data());
  auto at = [&](int64_t head, int64_t page) {
    return reinterpret_cast<const bf16*>(dst.data() + (head * 2 + page) * g.content_bytes());
  };
  // Head 1, token 2 (page 1, slot 0): K row = k[2*8 + 4 ..], V after page_tokens rows of K.
  EXPECT_EQ(Bf16ToFloat(at(1, 1)[0]), k[2 * 8 + 4]);
  EXPECT_EQ(Bf16ToFloat(at(1, 1)[2 * 4]), v[2 * 8 + 4]);
  // Head 0, token 1 (page 0, slot 1).
  EXPECT_EQ(Bf16ToFloat(at(0, 0)[4 + 3]), k[1 * 8 + 3]);
  // Slot 1 of the last page is zero in K and V.
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(Bf16ToFloat(at(1, 1)[4 + i]), 0.0f);
    EXPECT_EQ(Bf16ToFloat(at(1, 1)[8 + 4 + i]), 0.0f);
  }
}

TEST(PackLayerPagesTest, ChunkByChunkEqualsAllAtOnce) {
  KvPageGeometry g{1, 3, 8, 4};
  const int64_t tokens = 19, stride = 3 * 8;
  std::vector<float> k(tokens * stride), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = 0.5f * static_cast<float>(i);
    v[i] = -0.25f * static_cast<float>(i);
  }
  std::vector<uint8_t> whole(g.pages_per_layer(tokens) * g.content_bytes(), 0xCD);
  PackLayerPages(g, tokens, k.data(), v.data(), stride, whole.data());
  std::vector<uint8_t> chunked(whole.size(), 0);
  for (int64_t first : {0, 5, 8, 16}) {  // chunks [0,5) [5,8) [8,16) [16,19)
    const int64_t end = first == 0 ? 5 : first == 5 ? 8 : first == 8 ? 16 : 19;
    PackLayerRows(g, tokens, first, end, k.data() + first * stride, v.data() + first * stride,
                  stride, chunked.data());
  }
  EXPECT_EQ(chunked, whole);
}

TEST(PackPageRangeTest, EachRangeIsItsPagesOfTheWholeLayerWithAZeroTail) {
  KvPageGeometry g{1, 3, 8, 4};
  const int64_t tokens = 19, stride = 3 * 8, per_head = g.pages_per_head(tokens);  // 5 pages
  std::vector<float> k(tokens * stride), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = 1.0f + 0.5f * static_cast<float>(i);
    v[i] = -1.0f - 0.25f * static_cast<float>(i);
  }
  std::vector<uint8_t> whole(g.pages_per_layer(tokens) * g.content_bytes());
  PackLayerPages(g, tokens, k.data(), v.data(), stride, whole.data());
  const size_t cb = g.content_bytes();
  for (auto [p0, p1] : {std::pair<int64_t, int64_t>{0, 2}, {2, 5}, {4, 5}, {0, 5}}) {
    const int64_t count = p1 - p0;
    std::vector<uint8_t> slot(g.num_kv_heads * count * cb, 0xEE);  // dirty, as a reused slot is
    PackPageRange(g, tokens, p0, p1, k.data(), v.data(), stride, slot.data());
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      for (int64_t i = 0; i < count; ++i) {
        const uint8_t* want = whole.data() + (h * per_head + p0 + i) * cb;
        const uint8_t* got = slot.data() + (h * count + i) * cb;
        EXPECT_TRUE(std::equal(want, want + cb, got)) << "head " << h << " page " << p0 + i;
      }
    }
  }
}

}  // namespace
}  // namespace fluxion::transfer
