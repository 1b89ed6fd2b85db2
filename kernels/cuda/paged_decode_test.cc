// GPU paged decode attention (both kernels, every page size) against reference::PagedAttention,
// over an arena in device memory and over pinned host memory read in place (zero-copy), whole and
// split into chunks merged by log-sum-exp.
#include "kernels/cuda/paged_decode.h"

#include <cmath>
#include <random>
#include <vector>

#include "common/half.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/decode_ops.h"
#include "kernels/cuda/device_buffers_testing.h"
#include "kernels/reference/compare.h"
#include "kernels/reference/reference_ops.h"

namespace fluxion::kernels::cuda {
namespace {

struct Case {
  int64_t head_dim;
  int64_t group;
  int64_t page_tokens = 16;
  PagedKernel kernel = PagedKernel::kV5;
};

class PagedDecodeTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

constexpr int32_t kPages = 400;

// Random pages, and per item a random list of spans over random pages (partial spans included).
struct Problem {
  std::vector<bf16> arena;
  size_t page_bytes = 0;
  std::vector<PageSpan> spans;
  std::vector<int32_t> item_begin;  // [items + 1]
  std::vector<std::vector<float>> q;
  int64_t page_tokens = 16;
};

Problem MakeProblem(int64_t head_dim, int64_t group, int64_t page_tokens,
                    const std::vector<int>& spans_per_item, uint32_t seed) {
  Problem p;
  p.page_tokens = page_tokens;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.5f);
  const int64_t page_elems = 2 * page_tokens * head_dim + 32;  // padding: page_bytes > content
  p.page_bytes = page_elems * sizeof(bf16);
  p.arena.resize(kPages * page_elems);
  for (bf16& x : p.arena) x = FloatToBf16(dist(rng));
  std::uniform_int_distribution<int32_t> page(0, kPages - 1), row(0, page_tokens - 1);
  for (int count : spans_per_item) {
    p.item_begin.push_back(p.spans.size());
    for (int s = 0; s < count; ++s) {
      const int32_t first = s % 3 == 0 ? row(rng) : 0;
      const int32_t rows = s % 3 == 0 ? std::uniform_int_distribution<int32_t>(
                                            1, page_tokens - first)(rng)
                                      : page_tokens;
      p.spans.push_back({page(rng), first, rows});
    }
    std::vector<float> q(group * head_dim);
    for (float& x : q) x = dist(rng);
    p.q.push_back(q);
  }
  p.item_begin.push_back(p.spans.size());
  return p;
}

void Reference(const Problem& p, int64_t head_dim, int64_t group, float scale, size_t item,
               std::vector<float>* out, std::vector<float>* lse) {
  out->assign(group * head_dim, 0.0f);
  lse->assign(group, 0.0f);
  PagedKvView view{reinterpret_cast<const uint8_t*>(p.arena.data()), p.page_bytes, p.page_tokens,
                   head_dim};
  reference::PagedAttention(view, p.spans.data() + p.item_begin[item],
                            p.item_begin[item + 1] - p.item_begin[item],
                            DecodeQuery{p.q[item].data(), group, scale},
                            AttentionState{out->data(), lse->data()});
}

void ExpectStateNear(const std::vector<float>& out, const std::vector<float>& lse,
                     const std::vector<float>& want_out, const std::vector<float>& want_lse,
                     const std::string& what) {
  bool empty = std::isinf(want_lse[0]);
  if (empty) {
    for (float v : out) EXPECT_EQ(v, 0.0f) << what;
  } else {
    EXPECT_LT(reference::RelativeL2Error(out, want_out), 2e-5) << what;
  }
  for (size_t h = 0; h < lse.size(); ++h) {
    if (std::isinf(want_lse[h])) {
      EXPECT_EQ(lse[h], want_lse[h]) << what;
    } else {
      EXPECT_NEAR(lse[h], want_lse[h], 1e-4 * std::max(1.0f, std::fabs(want_lse[h]))) << what;
    }
  }
}

// Runs every item of the problem over `arena` (device memory or mapped pinned host memory, holding
// p.arena) and compares each with the reference.
void ExpectItemsMatchReference(const Problem& p, const uint8_t* arena, const Case& c,
                               const std::string& what) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  DeviceBuffers dev;
  const PageSpan* spans = dev.ToDevice(p.spans);
  const size_t items = p.q.size();
  std::vector<PagedItem> host_items(items);
  std::vector<float*> outs(items), lses(items);
  for (size_t i = 0; i < items; ++i) {
    host_items[i] = {dev.ToDevice(p.q[i]), p.item_begin[i], p.item_begin[i + 1],
                     outs[i] = dev.ToDevice(std::vector<float>(c.group * c.head_dim, NAN)),
                     lses[i] = dev.ToDevice(std::vector<float>(c.group, NAN))};
  }
  ASSERT_EQ(PagedDecodeAttention(arena, p.page_bytes, c.page_tokens, c.head_dim, spans,
                                 dev.ToDevice(host_items), items, c.group, scale, nullptr,
                                 c.kernel),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < items; ++i) {
    std::vector<float> want_out, want_lse;
    Reference(p, c.head_dim, c.group, scale, i, &want_out, &want_lse);
    ExpectStateNear(DeviceBuffers::ToHost(outs[i], c.group * c.head_dim),
                    DeviceBuffers::ToHost(lses[i], c.group), want_out, want_lse,
                    what + " item " + std::to_string(i));
  }
}

TEST_P(PagedDecodeTest, MatchesReferenceFromDeviceMemory) {
  const Case c = GetParam();
  const Problem p = MakeProblem(c.head_dim, c.group, c.page_tokens, {1, 0, 5, 40, 300}, 3);
  DeviceBuffers dev;
  ExpectItemsMatchReference(p, reinterpret_cast<const uint8_t*>(dev.ToDevice(p.arena)), c,
                            "device");
}

TEST_P(PagedDecodeTest, ChunksMergedByLseEqualTheWholeItem) {
  const auto [head_dim, group, page_tokens, kernel] = GetParam();
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const Problem p = MakeProblem(head_dim, group, page_tokens, {500}, 9);
  const std::vector<int32_t> bounds =
      SplitByRows(p.spans.data(), 0, p.spans.size(), 700 * page_tokens / 16);
  ASSERT_GT(bounds.size(), 3u);
  DeviceBuffers dev;
  const uint8_t* arena = reinterpret_cast<const uint8_t*>(dev.ToDevice(p.arena));
  const float* q = dev.ToDevice(p.q[0]);
  const size_t chunks = bounds.size() - 1;
  float* outs = dev.ToDevice(std::vector<float>(chunks * group * head_dim, NAN));
  float* lses = dev.ToDevice(std::vector<float>(chunks * group, NAN));
  std::vector<PagedItem> items;
  for (size_t c = 0; c < chunks; ++c) {
    items.push_back({q, bounds[c], bounds[c + 1], outs + c * group * head_dim, lses + c * group});
  }
  // A padding item (out == nullptr) among them is skipped.
  items.push_back({q, 0, static_cast<int32_t>(p.spans.size()), nullptr, nullptr});
  ASSERT_EQ(PagedDecodeAttention(arena, p.page_bytes, page_tokens, head_dim,
                                 dev.ToDevice(p.spans), dev.ToDevice(items), items.size(), group,
                                 scale, nullptr, kernel),
            cudaSuccess);
  // One pass over all chunks (MergeChunks) into separate outputs, then the pairwise fold below.
  float* merged_out = dev.ToDevice(std::vector<float>(group * head_dim, NAN));
  float* merged_lse = dev.ToDevice(std::vector<float>(group, NAN));
  const std::vector<int32_t> chunk_begin = {0, static_cast<int32_t>(chunks)};
  ASSERT_EQ(MergeChunks(outs, lses, dev.ToDevice(chunk_begin), 1, group, head_dim, merged_out,
                        merged_lse, nullptr),
            cudaSuccess);
  for (size_t c = 1; c < chunks; ++c) {  // fold chunk c into chunk 0, state by state (per head)
    ASSERT_EQ(MergeStates(outs, lses, outs + c * group * head_dim, lses + c * group, group,
                          head_dim, nullptr),
              cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> want_out, want_lse;
  Reference(p, head_dim, group, scale, 0, &want_out, &want_lse);
  ExpectStateNear(DeviceBuffers::ToHost(outs, group * head_dim),
                  DeviceBuffers::ToHost(lses, group), want_out, want_lse, "merged chunks");
  ExpectStateNear(DeviceBuffers::ToHost(merged_out, group * head_dim),
                  DeviceBuffers::ToHost(merged_lse, group), want_out, want_lse, "MergeChunks");
}

// Defined last: gtest runs a suite's tests in definition order, so every device-memory case has
// run before the first read over PCIe (a fault there would poison the context for what follows).
TEST_P(PagedDecodeTest, MatchesReferenceFromPinnedHostMemory) {
  const Case c = GetParam();
  const Problem p = MakeProblem(c.head_dim, c.group, c.page_tokens, {1, 0, 5, 40, 300}, 3);
  // Pinned host copy, mapped into the device's address space.
  std::vector<bf16> host_arena = p.arena;
  ASSERT_EQ(cudaHostRegister(host_arena.data(), host_arena.size() * sizeof(bf16),
                             cudaHostRegisterMapped | cudaHostRegisterReadOnly),
            cudaSuccess);
  void* mapped = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(&mapped, host_arena.data(), 0), cudaSuccess);
  ExpectItemsMatchReference(p, static_cast<const uint8_t*>(mapped), c, "pinned");
  ASSERT_EQ(cudaHostUnregister(host_arena.data()), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PagedDecodeTest,
    ::testing::Values(Case{128, 4}, Case{128, 1}, Case{64, 8}, Case{128, 7}, Case{128, 2},
                      Case{64, 3}, Case{128, 4, 8}, Case{128, 4, 32}, Case{128, 4, 64},
                      Case{64, 8, 64}, Case{128, 5, 32}, Case{128, 8, 8}, Case{128, 7, 32},
                      Case{64, 4, 16}, Case{64, 3, 32}, Case{128, 5, 8}, Case{128, 1, 32},
                      Case{128, 3, 32}, Case{128, 4, 16, PagedKernel::kV3},
                      Case{128, 7, 16, PagedKernel::kV3}, Case{64, 8, 32, PagedKernel::kV3}),
    [](const auto& info) {
      return std::string(PagedKernelName(info.param.kernel)) + "_d" +
             std::to_string(info.param.head_dim) + "_g" + std::to_string(info.param.group) +
             "_p" + std::to_string(info.param.page_tokens);
    });

TEST(ChooseChunkRowsTest, AimsAtFourBlocksPerSmWithinBounds) {
  EXPECT_EQ(ChooseChunkRows(8 * 32768, 132), 512);  // B=1, 8 KV heads at 32K: 512 blocks
  EXPECT_EQ(ChooseChunkRows(1000, 132), 128);
  EXPECT_EQ(ChooseChunkRows(int64_t{1} << 40, 132), 8192);
  EXPECT_EQ(ChooseChunkRows(0, 0), 128);
}

TEST(SplitByRowsTest, CutsBetweenSpansOnly) {
  const std::vector<PageSpan> spans = {{0, 0, 16}, {1, 0, 16}, {2, 3, 5}, {3, 0, 16}, {4, 0, 40}};
  EXPECT_EQ(SplitByRows(spans.data(), 0, 5, 1000), (std::vector<int32_t>{0, 5}));
  EXPECT_EQ(SplitByRows(spans.data(), 0, 5, 32), (std::vector<int32_t>{0, 2, 4, 5}));
  EXPECT_EQ(SplitByRows(spans.data(), 2, 2, 32), (std::vector<int32_t>{2}));
  EXPECT_EQ(SplitByRows(spans.data(), 4, 5, 8), (std::vector<int32_t>{4, 5}));
}

TEST(ChoosePagedChunkRowsTest, V5FillsOneWave) {
  // B=1 at 32K, 8 KV heads, 132 SMs: 264 slots, 33 chunks per item of 993 -> 1008 rows.
  EXPECT_EQ(ChoosePagedChunkRows(PagedKernel::kV5, 8 * 32768, 8, 132), 1008);
  // B=16 at 128K: 128 items, 2 chunks each.
  EXPECT_EQ(ChoosePagedChunkRows(PagedKernel::kV5, 128 * 131072, 128, 132), 65536);
  // More items than slots: one chunk each, never below the minimum.
  EXPECT_EQ(ChoosePagedChunkRows(PagedKernel::kV5, 1000 * 100, 1000, 132), kMinPagedChunkRows);
  EXPECT_EQ(ChoosePagedChunkRows(PagedKernel::kV5, 0, 0, 0), kMinPagedChunkRows);
  EXPECT_EQ(ChoosePagedChunkRows(PagedKernel::kV3, 8 * 32768, 8, 132),
            ChooseChunkRows(8 * 32768, 132));
}

TEST(PagedKernelNameTest, RoundTrips) {
  for (PagedKernel k : {PagedKernel::kV3, PagedKernel::kV5}) {
    PagedKernel back = PagedKernel::kV3;
    ASSERT_TRUE(PagedKernelFromName(PagedKernelName(k), &back)) << PagedKernelName(k);
    EXPECT_EQ(back, k);
  }
  PagedKernel unchanged = PagedKernel::kV5;
  EXPECT_FALSE(PagedKernelFromName("v4", &unchanged));
  EXPECT_EQ(unchanged, PagedKernel::kV5);
}

TEST(PagedDecodeArgsTest, RefusesUnsupportedShapes) {
  PagedItem item;
  EXPECT_EQ(PagedDecodeAttention(nullptr, 4096, 16, 96, nullptr, &item, 1, 4, 1.0f, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(PagedDecodeAttention(nullptr, 4096, 16, 128, nullptr, &item, 1, 9, 1.0f, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(PagedDecodeAttention(nullptr, 100, 16, 128, nullptr, &item, 1, 4, 1.0f, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(PagedDecodeAttention(nullptr, 8192, 15, 128, nullptr, &item, 1, 4, 1.0f, nullptr),
            cudaErrorInvalidValue);  // odd page_tokens
  EXPECT_EQ(PagedDecodeAttention(nullptr, 8200, 16, 128, nullptr, &item, 1, 4, 1.0f, nullptr),
            cudaErrorInvalidValue);  // page_bytes not 16-byte aligned
  EXPECT_EQ(PagedDecodeAttention(nullptr, 32768, 64, 128, nullptr, &item, 1, 4, 1.0f, nullptr,
                                 PagedKernel::kV3),
            cudaErrorInvalidValue);  // v3 has no 64-token pages
  EXPECT_EQ(PagedDecodeAttention(nullptr, 32768, 24, 128, nullptr, &item, 1, 4, 1.0f, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace fluxion::kernels::cuda
