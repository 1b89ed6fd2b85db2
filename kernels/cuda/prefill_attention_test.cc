// Device tests of the prefill node's kernels (skip without a device): the page writer against the
// wire packer (transfer/kv_pages.h), the flash-style attention against the reference causal
// attention over the same bf16-rounded inputs, and the sparse-state capture against
// model::CaptureSparseState over the same keys.
#include "kernels/cuda/prefill_attention.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/half.h"
#include "common/random_testing.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device_buffers_testing.h"
#include "kernels/cuda/page_meta_encode.h"
#include "kernels/cuda/sparse_capture.h"
#include "kernels/reference/reference_ops.h"
#include "model/sparse_state.h"
#include "transfer/kv_pages.h"
#include "transfer/page_meta.h"

namespace fluxion::kernels::cuda {
namespace {

std::vector<float> Random(size_t n, uint64_t seed, float scale = 1.0f) {
  return RandomNormal<std::mt19937_64>(n, seed, scale);
}

struct Case {
  int64_t head_dim, heads, kv_heads, page_tokens, first, rows;
};

class PrefillKernelsTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

// The pages of keys/values [0, first + rows): earlier rows written as one earlier chunk, these
// rows as the current one; both through WriteLayerPages.
struct DevicePages {
  LayerPages pages;
  std::vector<uint8_t> host;  // what PackLayerRows makes of the same rows
};

TEST_P(PrefillKernelsTest, PagesMatchTheWirePackerAndAttentionMatchesTheReference) {
  const Case c = GetParam();
  const int64_t total = c.first + c.rows, d = c.head_dim, hkv = c.kv_heads, hq = c.heads;
  const int64_t row = hkv * d;
  const std::vector<float> k = Random(total * row, 1), v = Random(total * row, 2);
  const std::vector<float> q = Random(c.rows * hq * d, 3);
  transfer::KvPageGeometry geo{1, hkv, d, c.page_tokens};
  const int64_t pph = geo.pages_per_head(total);
  std::vector<uint8_t> want(geo.pages_per_layer(total) * geo.content_bytes(), 0);
  transfer::PackLayerPages(geo, total, k.data(), v.data(), row, want.data());

  DeviceBuffers dev;
  uint8_t* pages = dev.ToDevice(std::vector<uint8_t>(want.size(), 0xff));
  ASSERT_EQ(cudaMemset(pages, 0, want.size()), cudaSuccess);  // the prefill clears them first
  const LayerPages lp{pages, hkv, d, c.page_tokens, pph};
  const float* dk = dev.ToDevice(k);
  const float* dv = dev.ToDevice(v);
  ASSERT_EQ(WriteLayerPages(lp, dk, dv, row, 0, c.first, nullptr), cudaSuccess);
  ASSERT_EQ(WriteLayerPages(lp, dk + c.first * row, dv + c.first * row, row, c.first, c.rows,
                            nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(DeviceBuffers::ToHost(pages, want.size()), want);

  float* out = dev.ToDevice(std::vector<float>(c.rows * hq * d, NAN));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  ASSERT_EQ(CausalPrefillAttention(lp, dev.ToDevice(q), c.first, c.rows, hq, scale, out, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = DeviceBuffers::ToHost(out, c.rows * hq * d);

  std::vector<float> ref(c.rows * hq * d);
  AttentionParams p{c.rows, c.first, hq, hkv, d, scale};
  reference::CausalAttention(RoundedToBf16(q).data(), RoundedToBf16(k).data(),
                             RoundedToBf16(v).data(), ref.data(), p);
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << i;
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - ref[i]));
  }
  // The probabilities go through bf16 before the product with V (as FlashAttention's do).
  EXPECT_LT(worst, 1.5e-2) << "max |flash - reference|";
}

// The page records computed on the device equal the host encoder's byte for byte, whether the
// layer is encoded at once or range by range as its chunks complete (the prefill's pieces).
TEST_P(PrefillKernelsTest, PageMetaMatchesTheHostEncoder) {
  const Case c = GetParam();
  const int64_t total = c.first + c.rows, d = c.head_dim, hkv = c.kv_heads, row = hkv * d;
  std::vector<float> k = Random(total * row, 11), v = Random(total * row, 12);
  // Ties and signed zeros where the fold order decides which bits win.
  for (int64_t i = 0; i < total * row; i += 7) k[i] = (i / 7) % 2 == 0 ? 0.0f : -0.0f;
  transfer::KvPageGeometry geo{1, hkv, d, c.page_tokens};
  const int64_t pph = geo.pages_per_head(total);
  std::vector<uint8_t> packed(geo.pages_per_layer(total) * geo.content_bytes(), 0);
  transfer::PackLayerPages(geo, total, k.data(), v.data(), row, packed.data());
  std::vector<uint8_t> want(transfer::PageMetaLayerBytes(geo, total));
  transfer::EncodeLayerPageMeta(geo, total, packed.data(), want.data());

  DeviceBuffers dev;
  const LayerPages lp{dev.ToDevice(packed), hkv, d, c.page_tokens, pph};
  uint8_t* whole = dev.ToDevice(std::vector<uint8_t>(want.size(), 0xab));
  uint8_t* ranged = dev.ToDevice(std::vector<uint8_t>(want.size(), 0xab));
  ASSERT_EQ(EncodePageMeta(lp, total, 0, pph, whole, nullptr), cudaSuccess);
  const int64_t split = c.first / c.page_tokens;  // the earlier chunk's complete pages
  ASSERT_EQ(EncodePageMeta(lp, total, 0, split, ranged, nullptr), cudaSuccess);
  ASSERT_EQ(EncodePageMeta(lp, total, split, pph + 5 /* clamped */, ranged, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(DeviceBuffers::ToHost(whole, want.size()), want);
  EXPECT_EQ(DeviceBuffers::ToHost(ranged, want.size()), want);
  EXPECT_EQ(EncodePageMeta(lp, total, -1, pph, whole, nullptr), cudaErrorInvalidValue);
}

TEST_P(PrefillKernelsTest, CaptureMatchesTheCpuCapture) {
  const Case c = GetParam();
  const int64_t tokens = c.first + c.rows, d = c.head_dim, hkv = c.kv_heads, hq = c.heads;
  const int64_t rows = std::min<int64_t>(32, tokens);
  const int64_t row = hkv * d;
  // Peaked enough that the tables and the need fraction are not flat.
  const std::vector<float> k = RoundedToBf16(Random(tokens * row, 4, 2.0f));
  const std::vector<float> tail_q = Random(rows * hq * d, 5, 1.0f);
  transfer::KvPageGeometry geo{1, hkv, d, c.page_tokens};
  std::vector<uint8_t> packed(geo.pages_per_layer(tokens) * geo.content_bytes(), 0);
  transfer::PackLayerPages(geo, tokens, k.data(), k.data(), row, packed.data());
  DeviceBuffers dev;
  const LayerPages lp{dev.ToDevice(packed), hkv, d, c.page_tokens, geo.pages_per_head(tokens)};
  model::SparseStateParams sp;
  TailCaptureParams params{tokens, rows, hq, 1.0f / std::sqrt(static_cast<float>(d)),
                           sp.decay, sp.sink_tokens, sp.local_tokens, sp.coverage};
  std::vector<uint8_t> scratch(TailCaptureScratchBytes(rows, hq, hkv, tokens));
  float* tables = dev.ToDevice(std::vector<float>(2 * hkv * tokens));
  auto* row_heads = dev.ToDevice(std::vector<TailRowHeadStats>(rows * hq));
  auto* middles = dev.ToDevice(std::vector<TailRowMiddle>(rows * hkv));
  ASSERT_EQ(CaptureLayerTail(lp, dev.ToDevice(tail_q), params, dev.ToDevice(scratch), tables,
                             tables + hkv * tokens, row_heads, middles, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = DeviceBuffers::ToHost(tables, 2 * hkv * tokens);
  const std::vector<TailRowHeadStats> got_rows = DeviceBuffers::ToHost(row_heads, rows * hq);
  const std::vector<TailRowMiddle> got_mid = DeviceBuffers::ToHost(middles, rows * hkv);

  std::vector<int64_t> positions(rows);
  for (int64_t i = 0; i < rows; ++i) positions[i] = tokens - rows + i;
  model::AttentionShape shape{1, hq, hkv, d, params.scale};
  absl::StatusOr<model::SparseState> want =
      model::CaptureSparseState({k.data()}, tokens, {tail_q}, {positions}, shape, sp);
  ASSERT_TRUE(want.ok()) << want.status();
  const int64_t group = hq / hkv;
  for (int64_t h = 0; h < hkv; ++h) {
    const model::HeadSparseState& hs = want->head(0, static_cast<int>(h));
    for (int64_t j = 0; j < tokens; ++j) {
      ASSERT_NEAR(got[h * tokens + j], hs.vertical[j], 1e-4 + 1e-3 * hs.vertical[j]) << h << " " << j;
      ASSERT_NEAR(got[(hkv + h) * tokens + j], hs.slash[j], 1e-4 + 1e-3 * hs.slash[j]) << h << " " << j;
    }
    double sink = 0, local = 0, entropy = 0, share = 0, need = 0;
    int64_t need_rows = 0;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        sink += got_rows[i * hq + h * group + g].sink;
        local += got_rows[i * hq + h * group + g].local;
        entropy += got_rows[i * hq + h * group + g].entropy;
      }
      const TailRowMiddle& m = got_mid[i * hkv + h];
      share = std::max(share, std::min(1.0, static_cast<double>(m.share)));
      if (m.middle > 0 && m.share > 0) {
        need += static_cast<double>(m.needed) / m.middle;
        ++need_rows;
      }
    }
    EXPECT_NEAR(sink / (rows * group), hs.sink_mass, 1e-4);
    EXPECT_NEAR(local / (rows * group), hs.local_mass, 1e-4);
    EXPECT_NEAR(entropy / (rows * group), hs.entropy, 1e-3);
    EXPECT_NEAR(share, hs.middle_share, 1e-4);
    if (need_rows > 0) {
      // A float sum may cross the coverage target one entry earlier or later than the double one.
      EXPECT_NEAR(need / need_rows, hs.need_fraction, 2.0 / std::max<int64_t>(1, tokens - 68));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefillKernelsTest,
    ::testing::Values(Case{32, 8, 4, 16, 0, 200},      // the tiny model's heads, one chunk
                      Case{64, 14, 2, 16, 96, 77},      // group 7, a second chunk
                      Case{128, 32, 8, 16, 0, 130},     // Llama-3.1-8B heads
                      Case{128, 32, 8, 32, 1000, 300},  // 32-token pages, a later chunk
                      Case{128, 4, 4, 16, 2048, 64}));  // no GQA, a longer prefix

}  // namespace
}  // namespace fluxion::kernels::cuda
