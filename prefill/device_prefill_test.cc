// Device tests of the GPU prefill (skip without a device): the prompt's pages, the first token and
// the sparse state against the CPU model's prefill of the same prompt (model::Model::Forward with
// DenseAttention, packed by transfer::PackLayerPages, captured by model::CaptureSparseState), for
// the trained Llama-shaped model (head_dim 32, GQA 2) and random Qwen2.5-0.5B shapes (head_dim 64,
// GQA 7, q/k/v biases), over prompts that span several chunks.
#include "prefill/device_prefill.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "gtest/gtest.h"
#include "model/cuda_dense_ops.h"
#include "model/dense_attention.h"
#include "model/generator.h"
#include "model/model.h"
#include "model/random_model.h"
#include "model/sparse_state.h"
#include "transfer/kv_pages.h"
#include "transfer/page_meta.h"

namespace fluxion::prefill {
namespace {

bool HasDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

struct CpuPrefill {
  std::vector<uint8_t> pages;  // PAGE_ORDER_LAYER_HEAD_PAGE
  std::vector<float> logits;
  model::SparseState state;
};

CpuPrefill RunOnCpu(const model::Model& m, const std::vector<int32_t>& prompt, int64_t pt) {
  const model::AttentionShape shape = m.attention_shape();
  const int64_t n = static_cast<int64_t>(prompt.size());
  auto owned = std::make_unique<model::DenseAttention>(shape);
  model::DenseAttention* dense = owned.get();
  dense->RecordQueries(std::max<int64_t>(0, n - model::kPrefillTailRows), n);
  model::Sequence seq(std::move(owned));
  CpuPrefill out;
  EXPECT_TRUE(m.Forward(seq, prompt, &out.logits).ok());
  transfer::KvPageGeometry geo{shape.num_layers, shape.num_kv_heads, shape.head_dim, pt};
  const size_t layer_bytes = geo.pages_per_layer(n) * geo.content_bytes();
  out.pages.assign(layer_bytes * shape.num_layers, 0);
  for (int l = 0; l < shape.num_layers; ++l) {
    transfer::PackLayerPages(geo, n, dense->keys(l), dense->values(l),
                             shape.num_kv_heads * shape.head_dim, out.pages.data() + l * layer_bytes);
  }
  absl::StatusOr<model::SparseState> st = model::CaptureSparseState(*dense, shape);
  EXPECT_TRUE(st.ok()) << st.status();
  out.state = *std::move(st);
  return out;
}

int32_t Argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

void ExpectMatchesCpu(const model::Model& m, int64_t n, int64_t chunk, int64_t pt) {
  const model::ModelConfig& c = m.config();
  std::mt19937 rng(7);
  std::vector<int32_t> prompt(n);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % c.vocab_size);
  const CpuPrefill cpu = RunOnCpu(m, prompt, pt);

  absl::StatusOr<std::unique_ptr<model::DenseOps>> ops = model::NewCudaDenseOps(0);
  ASSERT_TRUE(ops.ok()) << ops.status();
  absl::StatusOr<model::ModelParams> params = m.UploadParams(**ops);
  ASSERT_TRUE(params.ok()) << params.status();
  DevicePrefillOptions options;
  options.chunk_tokens = chunk;
  absl::StatusOr<std::unique_ptr<DevicePrefill>> gpu =
      DevicePrefill::Create(c, *std::move(ops), *std::move(params), options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();

  std::vector<uint8_t> pages(cpu.pages.size(), 0xee);
  const transfer::KvPageGeometry geo{c.num_layers, c.num_kv_heads, c.head_dim, pt};
  std::vector<uint8_t> meta(transfer::PageMetaBytes(geo, n), 0xee);
  const int64_t per_head = geo.pages_per_head(n);
  const size_t cb = geo.content_bytes();
  const size_t layer_bytes = geo.pages_per_layer(n) * cb;
  const size_t meta_layer = transfer::PageMetaLayerBytes(geo, n);
  // What the engine does: pull the pages each piece completed, as [head][page] runs, and put
  // them in their places.
  auto pull = [&](int layer, int64_t p0, int64_t p1) -> absl::Status {
    std::vector<uint8_t> slot(c.num_kv_heads * (p1 - p0) * cb, 0xdd);
    absl::Status s = (*gpu)->CopyPages(layer, p0, p1, slot.data(), meta.data() + layer * meta_layer);
    if (!s.ok()) return s;
    for (int64_t h = 0; h < c.num_kv_heads; ++h) {
      std::copy_n(slot.data() + h * (p1 - p0) * cb, (p1 - p0) * cb,
                  pages.data() + layer * layer_bytes + (h * per_head + p0) * cb);
    }
    return absl::OkStatus();
  };
  std::vector<int64_t> covered(c.num_layers, 0);  // rows seen per layer, in order
  std::vector<int64_t> pulled(c.num_layers, 0);   // pages per head pulled per layer
  absl::StatusOr<DevicePrefillResult> r = (*gpu)->Run(
      prompt, pt, /*encode_meta=*/true, /*capture_state=*/true, [] { return false; },
      [&](int layer, int64_t first, int64_t end) -> absl::Status {
        EXPECT_EQ(first, covered[layer]) << "layer " << layer;
        covered[layer] = end;
        const int64_t complete = end == n ? per_head : end / pt;
        if (complete > pulled[layer]) {
          absl::Status s = pull(layer, pulled[layer], complete);
          pulled[layer] = complete;
          return s;
        }
        return absl::OkStatus();
      });
  ASSERT_TRUE(r.ok()) << r.status();
  for (int64_t rows : covered) EXPECT_EQ(rows, n);
  for (int64_t p : pulled) EXPECT_EQ(p, per_head);
  // After the run, before the next, the pages are still there to pull.
  std::vector<uint8_t> again(c.num_kv_heads * cb);
  ASSERT_TRUE((*gpu)->CopyPages(c.num_layers - 1, per_head - 1, per_head, again.data(), nullptr).ok());
  EXPECT_TRUE(std::equal(again.begin(), again.begin() + cb,
                         pages.data() + (c.num_layers - 1) * layer_bytes + (per_head - 1) * cb));
  EXPECT_EQ((*gpu)->CopyPages(0, 0, per_head + 1, again.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);

  // Pages: the device's K/V come from bf16 GEMMs, the CPU's from fp32 ones; both rounded to bf16.
  const bf16* got = reinterpret_cast<const bf16*>(pages.data());
  const bf16* want = reinterpret_cast<const bf16*>(cpu.pages.data());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < pages.size() / 2; ++i) {
    const double a = Bf16ToFloat(got[i]), b = Bf16ToFloat(want[i]);
    ASSERT_TRUE(std::isfinite(a)) << i;
    worst = std::max(worst, std::abs(a - b));
    scale = std::max(scale, std::abs(b));
  }
  EXPECT_LT(worst, 0.05 * scale) << "worst |gpu - cpu| page value vs the largest " << scale;

  // The records the device computed, piece by piece, are the host encoder's of the same pages.
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::vector<uint8_t> want_meta(meta_layer);
    transfer::EncodeLayerPageMeta(geo, n, pages.data() + l * layer_bytes, want_meta.data());
    EXPECT_TRUE(std::equal(want_meta.begin(), want_meta.end(), meta.begin() + l * meta_layer))
        << "page records of layer " << l;
  }

  EXPECT_EQ(Argmax(r->logits), Argmax(cpu.logits)) << "first greedy token";
  double lworst = 0, lscale = 0;
  for (size_t i = 0; i < cpu.logits.size(); ++i) {
    lworst = std::max(lworst, std::abs(static_cast<double>(r->logits[i]) - cpu.logits[i]));
    lscale = std::max(lscale, std::abs(static_cast<double>(cpu.logits[i])));
  }
  EXPECT_LT(lworst, 0.05 * lscale) << "logits";

  ASSERT_TRUE(r->state.has_value());
  const model::SparseState& gs = *r->state;
  ASSERT_TRUE(gs.CheckMatches(m.attention_shape(), n).ok());
  EXPECT_EQ(gs.tail_rows, cpu.state.tail_rows);
  // The device's attention differs from the CPU's by the bf16 rounding of q, k and the GEMMs: the
  // tables' mass is compared as a whole per head, the features within a few percent.
  for (size_t h = 0; h < gs.heads.size(); ++h) {
    const model::HeadSparseState &a = gs.heads[h], &b = cpu.state.heads[h];
    double dv = 0, sv = 0, ds = 0, ss = 0;
    for (int64_t j = 0; j < n; ++j) {
      dv += std::abs(a.vertical[j] - b.vertical[j]);
      sv += std::abs(b.vertical[j]);
      ds += std::abs(a.slash[j] - b.slash[j]);
      ss += std::abs(b.slash[j]);
    }
    EXPECT_LT(dv, 0.05 * sv + 1e-6) << "vertical table of head " << h;
    EXPECT_LT(ds, 0.05 * ss + 1e-6) << "slash table of head " << h;
    EXPECT_NEAR(a.sink_mass, b.sink_mass, 0.02) << h;
    EXPECT_NEAR(a.local_mass, b.local_mass, 0.02) << h;
    EXPECT_NEAR(a.middle_share, b.middle_share, 0.02) << h;
    EXPECT_NEAR(a.need_fraction, b.need_fraction, 0.03) << h;
    EXPECT_NEAR(a.entropy, b.entropy, 0.02 * std::max(1.0f, b.entropy)) << h;
  }
}

TEST(DevicePrefillTest, TrainedModelMatchesTheCpuPrefill) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  auto m = model::Model::Load(std::string(src ? src : ".") + "/models/fluxion-tiny-retrieval");
  ASSERT_TRUE(m.ok()) << m.status();
  ExpectMatchesCpu(**m, 1000, 256, 16);  // four chunks, the last partial
}

TEST(DevicePrefillTest, QwenShapesMatchTheCpuPrefill) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  auto config = model::PresetConfig("qwen2.5-0.5b");
  ASSERT_TRUE(config.ok());
  const std::string dir = ::testing::TempDir() + "/device_prefill_qwen";
  ASSERT_TRUE(model::WriteRandomModel(*config, 3, dir).ok());
  auto m = model::Model::Load(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  ExpectMatchesCpu(**m, 300, 128, 32);
}

TEST(DevicePrefillTest, ACallbackErrorStopsTheRun) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  auto m = model::Model::Load(std::string(src ? src : ".") + "/models/fluxion-tiny-retrieval");
  ASSERT_TRUE(m.ok()) << m.status();
  auto ops = model::NewCudaDenseOps(0);
  ASSERT_TRUE(ops.ok());
  auto params = (*m)->UploadParams(**ops);
  ASSERT_TRUE(params.ok());
  DevicePrefillOptions options;
  options.chunk_tokens = 64;
  auto gpu = DevicePrefill::Create((*m)->config(), *std::move(ops), *std::move(params), options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const std::vector<int32_t> prompt(640, 65);
  int calls = 0;
  auto r = (*gpu)->Run(prompt, 16, false, false, [] { return false; },
                       [&](int, int64_t, int64_t) -> absl::Status {
                         return ++calls == 3 ? absl::UnavailableError("peer gone")
                                             : absl::OkStatus();
                       });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  int cancelled_calls = 0;
  auto c = (*gpu)->Run(prompt, 16, false, false, [&] { return ++cancelled_calls > 5; },
                       [](int, int64_t, int64_t) { return absl::OkStatus(); });
  EXPECT_EQ(c.status().code(), absl::StatusCode::kCancelled) << c.status();
  // And the prefill still works after both.
  auto ok = (*gpu)->Run(prompt, 16, false, false, [] { return false; },
                        [](int, int64_t, int64_t) { return absl::OkStatus(); });
  EXPECT_TRUE(ok.ok()) << ok.status();
}

}  // namespace
}  // namespace fluxion::prefill
