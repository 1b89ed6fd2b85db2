// Device tests of the GPU prefill (skip without a device): the prompt's pages, the first token and
// the sparse state against the CPU model's prefill of the same prompt (model::Model::Forward with
// DenseAttention, packed by transfer::PackLayerPages, captured by model::CaptureSparseState), for
// the trained Llama-shaped model (head_dim 32, GQA 2) and random Qwen2.5-0.5B shapes (head_dim 64,
// GQA 7, q/k/v biases), over prompts that span several chunks; and batches: prompts packed into
// shared chunks each equal to the CPU's prefill of it alone, a prompt that fails or is cancelled
// leaving the others unharmed.
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

// The trained model of the checkout (FLUXION_SOURCE_DIR, else the working directory).
absl::StatusOr<std::unique_ptr<model::Model>> LoadTrainedModel() {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return model::Model::Load(std::string(src ? src : ".") + "/models/fluxion-tiny-retrieval");
}

int32_t Argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

std::vector<int32_t> RandomPrompt(const model::ModelConfig& c, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> prompt(n);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % c.vocab_size);
  return prompt;
}

std::unique_ptr<DevicePrefill> MakeGpu(const model::Model& m, int64_t chunk) {
  absl::StatusOr<std::unique_ptr<model::DenseOps>> ops = model::NewCudaDenseOps(0);
  EXPECT_TRUE(ops.ok()) << ops.status();
  if (!ops.ok()) return nullptr;
  absl::StatusOr<model::ModelParams> params = m.UploadParams(**ops);
  EXPECT_TRUE(params.ok()) << params.status();
  if (!params.ok()) return nullptr;
  DevicePrefillOptions options;
  options.chunk_tokens = chunk;
  absl::StatusOr<std::unique_ptr<DevicePrefill>> gpu =
      DevicePrefill::Create(m.config(), *std::move(ops), *std::move(params), options);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  return gpu.ok() ? *std::move(gpu) : nullptr;
}

// What the engine does with each piece, per prompt of a batch: check the pieces come in order,
// pull the pages each completed as [head][page] runs (with their records), and put them in their
// places of the whole prompt's pages.
class Puller {
 public:
  Puller(DevicePrefill* gpu, const model::ModelConfig& c, std::vector<int64_t> lengths,
         int64_t pt)
      : gpu_(gpu), c_(c), geo_{c.num_layers, c.num_kv_heads, c.head_dim, pt},
        lengths_(std::move(lengths)) {
    for (int64_t n : lengths_) {
      pages_.emplace_back(geo_.total_pages(n) * geo_.content_bytes(), 0xee);
      meta_.emplace_back(transfer::PageMetaBytes(geo_, n), 0xee);
      covered_.emplace_back(c.num_layers, 0);
      pulled_.emplace_back(c.num_layers, 0);
    }
  }

  absl::Status OnPiece(size_t prompt, int layer, int64_t first, int64_t end) {
    const int64_t n = lengths_[prompt];
    EXPECT_EQ(first, covered_[prompt][layer]) << "prompt " << prompt << " layer " << layer;
    covered_[prompt][layer] = end;
    const int64_t complete = end == n ? geo_.pages_per_head(n) : end / geo_.page_tokens;
    int64_t& pulled = pulled_[prompt][layer];
    if (complete <= pulled) return absl::OkStatus();
    absl::Status s = Pull(prompt, layer, pulled, complete);
    pulled = complete;
    return s;
  }

  // Every piece of `prompt` was reported and every page pulled.
  void ExpectComplete(size_t prompt) const {
    for (int64_t rows : covered_[prompt]) EXPECT_EQ(rows, lengths_[prompt]) << prompt;
    for (int64_t p : pulled_[prompt]) EXPECT_EQ(p, geo_.pages_per_head(lengths_[prompt])) << prompt;
  }
  const std::vector<uint8_t>& pages(size_t prompt) const { return pages_[prompt]; }
  const std::vector<uint8_t>& meta(size_t prompt) const { return meta_[prompt]; }
  const transfer::KvPageGeometry& geo() const { return geo_; }

 private:
  absl::Status Pull(size_t prompt, int layer, int64_t p0, int64_t p1) {
    const int64_t n = lengths_[prompt], per_head = geo_.pages_per_head(n);
    const size_t cb = geo_.content_bytes();
    const size_t layer_bytes = geo_.pages_per_layer(n) * cb;
    std::vector<uint8_t> slot(c_.num_kv_heads * (p1 - p0) * cb, 0xdd);
    absl::Status s =
        gpu_->CopyPages(prompt, layer, p0, p1, slot.data(),
                        meta_[prompt].data() + layer * transfer::PageMetaLayerBytes(geo_, n));
    if (!s.ok()) return s;
    for (int64_t h = 0; h < c_.num_kv_heads; ++h) {
      std::copy_n(slot.data() + h * (p1 - p0) * cb, (p1 - p0) * cb,
                  pages_[prompt].data() + layer * layer_bytes + (h * per_head + p0) * cb);
    }
    return absl::OkStatus();
  }

  DevicePrefill* gpu_;
  const model::ModelConfig& c_;
  const transfer::KvPageGeometry geo_;
  const std::vector<int64_t> lengths_;
  std::vector<std::vector<uint8_t>> pages_, meta_;
  std::vector<std::vector<int64_t>> covered_, pulled_;
};

// One prompt's GPU prefill (its pages and records as pulled, its result) against the CPU model's.
void ExpectLikeCpu(const model::Model& m, const std::vector<int32_t>& prompt, const Puller& got,
                   size_t index, const DevicePrefillResult& r) {
  const model::ModelConfig& c = m.config();
  const int64_t n = static_cast<int64_t>(prompt.size());
  const transfer::KvPageGeometry& geo = got.geo();
  const CpuPrefill cpu = RunOnCpu(m, prompt, geo.page_tokens);
  const std::vector<uint8_t>& pages = got.pages(index);
  const std::vector<uint8_t>& meta = got.meta(index);
  ASSERT_EQ(pages.size(), cpu.pages.size());
  const size_t layer_bytes = geo.pages_per_layer(n) * geo.content_bytes();
  const size_t meta_layer = transfer::PageMetaLayerBytes(geo, n);

  // Pages: the device's K/V come from bf16 GEMMs, the CPU's from fp32 ones; both rounded to bf16.
  const bf16* gp = reinterpret_cast<const bf16*>(pages.data());
  const bf16* want = reinterpret_cast<const bf16*>(cpu.pages.data());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < pages.size() / 2; ++i) {
    const double a = Bf16ToFloat(gp[i]), b = Bf16ToFloat(want[i]);
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
  double lworst = 0, lscale = 0;
  for (size_t i = 0; i < cpu.logits.size(); ++i) {
    lworst = std::max(lworst, std::abs(static_cast<double>(r.logits[i]) - cpu.logits[i]));
    lscale = std::max(lscale, std::abs(static_cast<double>(cpu.logits[i])));
  }
  EXPECT_LT(lworst, 0.05 * lscale) << "logits";
  // The same first greedy token where the CPU's top two stand apart by more than 2% of the logits'
  // scale; closer than that (a bf16 near-tie: random prompts on the trained model make some)
  // the GPU's token is one of the CPU's top two.
  std::vector<int32_t> order(cpu.logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                    [&](int32_t a, int32_t b) { return cpu.logits[a] > cpu.logits[b]; });
  const int32_t g = Argmax(r.logits);
  if (cpu.logits[order[0]] - cpu.logits[order[1]] > 0.02 * lscale) {
    EXPECT_EQ(g, order[0]) << "first greedy token";
  } else {
    EXPECT_TRUE(g == order[0] || g == order[1])
        << "first greedy token " << g << " is not one of the CPU's near-tied " << order[0]
        << " and " << order[1];
  }

  ASSERT_TRUE(r.state.has_value());
  const model::SparseState& gs = *r.state;
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

void ExpectMatchesCpu(const model::Model& m, int64_t n, int64_t chunk, int64_t pt) {
  const model::ModelConfig& c = m.config();
  const std::vector<int32_t> prompt = RandomPrompt(c, n, 7);
  std::unique_ptr<DevicePrefill> gpu = MakeGpu(m, chunk);
  ASSERT_NE(gpu, nullptr);
  Puller puller(gpu.get(), c, {n}, pt);
  absl::StatusOr<DevicePrefillResult> r = gpu->Run(
      prompt, pt, /*encode_meta=*/true, /*capture_state=*/true, [] { return false; },
      [&](int layer, int64_t first, int64_t end) { return puller.OnPiece(0, layer, first, end); });
  ASSERT_TRUE(r.ok()) << r.status();
  puller.ExpectComplete(0);
  // After the run, before the next, the pages are still there to pull.
  const transfer::KvPageGeometry& geo = puller.geo();
  const int64_t per_head = geo.pages_per_head(n);
  const size_t cb = geo.content_bytes(), layer_bytes = geo.pages_per_layer(n) * cb;
  std::vector<uint8_t> again(c.num_kv_heads * cb);
  ASSERT_TRUE(gpu->CopyPages(0, c.num_layers - 1, per_head - 1, per_head, again.data(), nullptr).ok());
  EXPECT_TRUE(std::equal(again.begin(), again.begin() + cb,
                         puller.pages(0).data() + (c.num_layers - 1) * layer_bytes +
                             (per_head - 1) * cb));
  EXPECT_EQ(gpu->CopyPages(0, 0, 0, per_head + 1, again.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu->CopyPages(1, 0, 0, 1, again.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  ExpectLikeCpu(m, prompt, puller, 0, *r);
}

TEST(DevicePrefillTest, TrainedModelMatchesTheCpuPrefill) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  auto m = LoadTrainedModel();
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

// Four prompts packed into chunks of 256 rows: the first spans two chunks and shares its second
// with the next two prompts' rows; the last is a single page. Each equals the CPU's prefill of it
// alone, piece order, pages, records, first token and sparse state.
TEST(DevicePrefillTest, ABatchOfPromptsInSharedChunksMatchesTheCpuPrefillOfEach) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  auto m = LoadTrainedModel();
  ASSERT_TRUE(m.ok()) << m.status();
  const model::ModelConfig& c = (*m)->config();
  const std::vector<int64_t> lengths = {300, 70, 530, 16};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<DevicePrompt> batch;
  for (size_t i = 0; i < lengths.size(); ++i) {
    prompts.push_back(RandomPrompt(c, lengths[i], 11 + static_cast<uint32_t>(i)));
  }
  for (const auto& p : prompts) batch.push_back({p, 16, true, true, [] { return false; }});
  std::unique_ptr<DevicePrefill> gpu = MakeGpu(**m, 256);
  ASSERT_NE(gpu, nullptr);
  Puller puller(gpu.get(), c, lengths, 16);
  auto r = gpu->RunBatch(batch, [&](size_t i, int layer, int64_t first, int64_t end) {
    return puller.OnPiece(i, layer, first, end);
  });
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "prompt " << i << " of " << lengths[i] << " tokens");
    ASSERT_TRUE((*r)[i].ok()) << (*r)[i].status();
    puller.ExpectComplete(i);
    ExpectLikeCpu(**m, prompts[i], puller, i, *(*r)[i]);
  }
}

// In a batch of three, the first is cancelled after a few layers and the second's callback fails
// on its third piece: each ends with its own error, the third equals the CPU's prefill of it.
TEST(DevicePrefillTest, APromptThatFailsOrIsCancelledLeavesTheOthersUnharmed) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  auto m = LoadTrainedModel();
  ASSERT_TRUE(m.ok()) << m.status();
  const model::ModelConfig& c = (*m)->config();
  const std::vector<int64_t> lengths = {640, 200, 400};
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < lengths.size(); ++i) {
    prompts.push_back(RandomPrompt(c, lengths[i], 21 + static_cast<uint32_t>(i)));
  }
  int polls = 0, calls = 0;
  std::vector<DevicePrompt> batch = {
      {prompts[0], 16, true, true, [&] { return ++polls > 5; }},
      {prompts[1], 16, true, true, [] { return false; }},
      {prompts[2], 16, true, true, [] { return false; }}};
  std::unique_ptr<DevicePrefill> gpu = MakeGpu(**m, 64);
  ASSERT_NE(gpu, nullptr);
  Puller puller(gpu.get(), c, lengths, 16);
  auto r = gpu->RunBatch(batch, [&](size_t i, int layer, int64_t first, int64_t end) {
    if (i == 1 && ++calls == 3) return absl::UnavailableError("peer gone");
    return puller.OnPiece(i, layer, first, end);
  });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].status().code(), absl::StatusCode::kCancelled) << (*r)[0].status();
  EXPECT_EQ((*r)[1].status().code(), absl::StatusCode::kUnavailable) << (*r)[1].status();
  ASSERT_TRUE((*r)[2].ok()) << (*r)[2].status();
  puller.ExpectComplete(2);
  ExpectLikeCpu(**m, prompts[2], puller, 2, *(*r)[2]);
}

TEST(DevicePrefillTest, ACallbackErrorStopsTheRun) {
  if (!HasDevice()) GTEST_SKIP() << "no CUDA device";
  auto m = LoadTrainedModel();
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
