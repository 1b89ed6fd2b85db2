// FillPageSpans against the span list built on the host (as decode/device/hbm_full_attention.cc
// once did): the same spans, exactly, for rows at different contexts and slots.
#include "kernels/cuda/page_spans.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device_buffers_testing.h"

namespace fluxion::kernels::cuda {
namespace {

TEST(PageSpansTest, DeviceListEqualsTheHostBuiltList) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const int64_t kv_heads = 8, page_tokens = 16, max_pages = 8200;
  const std::vector<int32_t> slots = {3, 0, 7, 1};
  const std::vector<int64_t> positions = {0, 15, 16, 131070};  // 1, 16, 17, 131071 tokens
  const int64_t rows = slots.size();
  std::vector<int64_t> indptr = {0};
  std::vector<PageSpan> want;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t context = positions[i] + 1;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t first = (slots[i] * kv_heads + h) * max_pages;
      for (int64_t t = 0; t < context; t += page_tokens) {
        want.push_back({static_cast<int32_t>(first + t / page_tokens), 0,
                        static_cast<int32_t>(std::min(page_tokens, context - t))});
      }
      indptr.push_back(static_cast<int64_t>(want.size()));
    }
  }
  DeviceBuffers dev;
  PageSpan poison{-1, -1, -1};
  PageSpan* spans = dev.ToDevice(std::vector<PageSpan>(want.size(), poison));
  ASSERT_EQ(FillPageSpans(dev.ToDevice(slots), dev.ToDevice(positions), dev.ToDevice(indptr),
                          rows, kv_heads, max_pages, page_tokens, spans, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<PageSpan> got = DeviceBuffers::ToHost(spans, want.size());
  for (size_t j = 0; j < want.size(); ++j) {
    ASSERT_EQ(got[j].page, want[j].page) << j;
    ASSERT_EQ(got[j].first_row, want[j].first_row) << j;
    ASSERT_EQ(got[j].rows, want[j].rows) << j;
  }
}

}  // namespace
}  // namespace fluxion::kernels::cuda
