// The CUDA resident window against the host one (the stand-in the hybrid executor is tested with
// on the CPU) on the same pages and steps: admission from host pages, ring appends that wrap,
// dense attention over the valid rows, and the merge of host partial states. Skips without a
// CUDA device.
#include "decode/device/cuda_resident_window.h"
#include "decode/step/step_executor_factory.h"

#include <cuda_runtime.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <string>

#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
#include "gtest/gtest.h"
#include "kernels/cpu/topk.h"
#include "kernels/cuda/device_buffers_testing.h"
#include "decode/device/hbm_full_attention.h"
#include "decode/step/hybrid_step_executor.h"
#include "decode/sparse/policy.h"
#include "decode/step/sparse_attention.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/cuda_dense_ops.h"
#include "model/dense_attention.h"
#include "model/random_model.h"

namespace fluxion::decode {
namespace {

using kernels::cuda::DeviceBuffers;

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::vector<float> Random(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

void ExpectNear(const std::vector<float>& a, const std::vector<float>& b, float tol,
                const char* what) {
  ASSERT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      EXPECT_EQ(a[i], b[i]) << what << " at " << i;
      continue;
    }
    worst = std::max(worst, std::abs(a[i] - b[i]) / (1.0f + std::abs(b[i])));
  }
  EXPECT_LT(worst, tol) << what;
}

// Logits of two runs whose attention differs only in fp32 summation order: the CUDA dense ops
// round every product's input rows to bf16, so a 1e-6 difference in an attention output moves the
// logits by up to bf16's resolution (measured on the H200: up to 3.9e-3 of the largest logit over
// 8 steps). 1e-2 of the largest logit leaves 2.5x margin and still catches a wrong row or merge
// (those move logits by whole units).
constexpr float kBf16StepTolerance = 1e-2f;

// True when row `ref` has its top two logits within `margin` (a near-tie a bf16 rounding may flip).
bool NearTie(const float* ref, int64_t vocab, float margin) {
  float first = -INFINITY, second = -INFINITY;
  for (int64_t j = 0; j < vocab; ++j) {
    if (ref[j] > first) {
      second = first;
      first = ref[j];
    } else if (ref[j] > second) {
      second = ref[j];
    }
  }
  return first - second < margin;
}

class CudaResidentWindowTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(CudaResidentWindowTest, MatchesTheHostWindowStepByStep) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const int64_t d = GetParam();
  WindowShape shape;
  shape.num_layers = 2;
  shape.num_heads = 8;
  shape.num_kv_heads = 2;
  shape.head_dim = d;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(d));
  shape.sink_tokens = 4;
  shape.window_tokens = 16;  // small, so the ring wraps within a few steps
  shape.max_requests = 4;
  shape.max_rows = 4;
  const int64_t page_tokens = 16;
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, d, page_tokens};
  auto arena = *KvArena::Create(kv_shape.page_bytes(), 1024);

  std::mt19937 rng(7);
  const std::vector<int64_t> lengths = {3, 19, 100};  // inside sinks, just past them, wrapped
  std::vector<std::unique_ptr<PagedKv>> kvs;
  for (int64_t n : lengths) {
    auto kv = *PagedKv::Create(arena.get(), kv_shape);
    const int64_t row = shape.num_kv_heads * d;
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const std::vector<float> k = Random(n * row, rng), v = Random(n * row, rng);
      ASSERT_TRUE(kv->Append(layer, n, k.data(), v.data(), row).ok());
    }
    kvs.push_back(std::move(kv));
  }

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto host = *NewHostResidentWindow(shape, page_tokens);
  auto cuda = NewCudaResidentWindow(shape, stream);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  std::vector<int> host_slots, cuda_slots;
  for (const auto& kv : kvs) {
    host_slots.push_back(*host->Admit(*kv, 0, false));
    auto slot = (*cuda)->Admit(*kv, 0, false);
    ASSERT_TRUE(slot.ok()) << slot.status();
    cuda_slots.push_back(*slot);
  }
  std::vector<int64_t> positions = lengths;
  const int64_t rows = static_cast<int64_t>(lengths.size());
  const int64_t q_n = rows * shape.num_heads * d, kv_n = rows * shape.num_kv_heads * d;
  DeviceBuffers dev;
  float* out_dev = dev.ToDevice(std::vector<float>(q_n));
  for (int step = 0; step < 24; ++step) {
    ASSERT_TRUE(host->BeginStep(host_slots, positions).ok());
    ASSERT_TRUE((*cuda)->BeginStep(cuda_slots, positions).ok());
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const std::vector<float> q = Random(q_n, rng), k = Random(kv_n, rng), v = Random(kv_n, rng);
      std::vector<float> host_out(q_n);
      host->AppendAndAttend(layer, q.data(), k.data(), v.data(), host_out.data());
      (*cuda)->AppendAndAttend(layer, dev.ToDevice(q), dev.ToDevice(k), dev.ToDevice(v), out_dev);
      // A host partial state to merge in; every third state empty (lse -inf).
      const std::vector<float> part_out = Random(q_n, rng);
      std::vector<float> part_lse = Random(rows * shape.num_heads, rng);
      for (size_t i = 0; i < part_lse.size(); i += 3) {
        part_lse[i] = -std::numeric_limits<float>::infinity();
      }
      host->MergeHostStates(part_out.data(), part_lse.data(), host_out.data());
      (*cuda)->MergeHostStates(part_out.data(), part_lse.data(), out_dev);
      ASSERT_TRUE((*cuda)->Sync().ok());
      ExpectNear(DeviceBuffers::ToHost(out_dev, q_n), host_out, 1e-4f, "merged output");
    }
    for (int64_t& p : positions) ++p;
  }
  cuda->reset();
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaResidentWindowTest, ::testing::Values(32, 64, 128));

// The device's page bounds and block scores against the host window's (which equal the CPU
// policy's scan bit for bit: resident_window_test.cc) over 80 steps of appends, for blocks of 1, 2
// and 4 pages, GQA groups of 4 and 7, and a row that outgrows the metadata mid-run.
class CudaBlockScoresTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(CudaBlockScoresTest, MatchTheHostWindowsScores) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto [d, group] = GetParam();
  WindowShape shape;
  shape.num_layers = 2;
  shape.num_kv_heads = 2;
  shape.num_heads = 2 * group;
  shape.head_dim = d;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(d));
  shape.max_requests = 4;
  shape.max_rows = 4;
  shape.page_tokens = 16;
  shape.max_context_tokens = 512;
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, d, shape.page_tokens};
  auto arena = *KvArena::Create(kv_shape.page_bytes(), 1024);
  std::mt19937 rng(11);
  const std::vector<int64_t> lengths = {40, 150, 480}, blocks = {16, 32, 64};
  std::vector<std::unique_ptr<PagedKv>> kvs;
  const int64_t kv_row = shape.num_kv_heads * d, q_row = shape.num_heads * d;
  for (int64_t n : lengths) {
    auto kv = *PagedKv::Create(arena.get(), kv_shape);
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const std::vector<float> k = Random(n * kv_row, rng), v = Random(n * kv_row, rng);
      ASSERT_TRUE(kv->Append(layer, n, k.data(), v.data(), kv_row).ok());
    }
    kvs.push_back(std::move(kv));
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto host = *NewHostResidentWindow(shape, shape.page_tokens);
  // Admission's bounds upload: one chunk (head_dim 32) or one head per chunk (the rest: the two
  // pinned chunks reused many times), converted on a pool of 3 threads.
  const kernels::cpu::CpuPool pool(3);  // outlives the window
  auto cuda = NewCudaResidentWindow(shape, stream, d == 32 ? kDefaultBoundsChunkBytes : 1);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  (*cuda)->set_cpu_pool(&pool);
  std::vector<int> host_slots, cuda_slots;
  for (size_t i = 0; i < kvs.size(); ++i) {
    host_slots.push_back(*host->Admit(*kvs[i], blocks[i], false));
    auto slot = (*cuda)->Admit(*kvs[i], blocks[i], false);
    ASSERT_TRUE(slot.ok()) << slot.status();
    cuda_slots.push_back(*slot);
  }
  std::vector<int64_t> positions = lengths;
  const int64_t rows = 3;
  DeviceBuffers dev;
  int64_t compared = 0, ranked_heads = 0;
  for (int step = 0; step < 80; ++step) {
    // Row 0 asks for scores every third step only: its bounds must follow in between.
    const std::vector<uint8_t> score = {static_cast<uint8_t>(step % 3 == 0), 1, 1};
    ASSERT_TRUE(host->BeginStep(host_slots, positions, score).ok());
    ASSERT_TRUE((*cuda)->BeginStep(cuda_slots, positions, score).ok());
    // Ranking (RankBlocks), in three phases: 0, row 0 scored and not ranked, rows 1 and 2 ranked
    // (row 2's range runs past its blocks: clamped), so the scores cross to the host too; 1, row
    // 0 not scored and rows 1 and 2 ranked, so only the picks cross; 2, nothing ranked.
    const int phase = step % 3;
    const std::vector<sparse::ScoredBlocks::Range> ranges =
        phase == 2 ? std::vector<sparse::ScoredBlocks::Range>{}
                   : std::vector<sparse::ScoredBlocks::Range>{
                         {0, 0, 0}, {1, 1 << 30, 3 + step % 5}, {0, 1 << 30, 1 + step}};
    host->RankBlocks(ranges);
    (*cuda)->RankBlocks(ranges);
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const std::vector<float> q = Random(rows * q_row, rng), k = Random(rows * kv_row, rng);
      host->ScoreBlocks(layer, q.data(), k.data());
      (*cuda)->ScoreBlocks(layer, dev.ToDevice(q), dev.ToDevice(k));
      ASSERT_TRUE(host->WaitBlockScores().ok());
      ASSERT_TRUE((*cuda)->WaitBlockScores().ok());
      for (int row = 0; row < rows; ++row) {
        SCOPED_TRACE("row " + std::to_string(row) + " step " + std::to_string(step) +
                     " layer " + std::to_string(layer));
        const sparse::ScoredBlocks h = host->block_scores(row), g = (*cuda)->block_scores(row);
        const bool ranked = phase != 2 && row != 0 && h.data != nullptr;
        if (h.data == nullptr) {
          ASSERT_EQ(g.data, nullptr);
          ASSERT_EQ(g.top, nullptr);
          continue;
        }
        ASSERT_EQ(h.head_stride, g.head_stride);
        ASSERT_EQ(h.block_tokens, g.block_tokens);
        if (phase == 1) {
          ASSERT_EQ(g.data, nullptr) << "every scored row ranked: the scores stay on the device";
        } else {
          ASSERT_NE(g.data, nullptr);
          for (int64_t j = 0; j < shape.num_kv_heads * h.head_stride; ++j) {
            ASSERT_NEAR(g.data[j], h.data[j], 1e-4f * (1.0f + std::abs(h.data[j])))
                << "score " << j;
            ++compared;
          }
        }
        ASSERT_EQ(h.top != nullptr, ranked);
        ASSERT_EQ(g.top != nullptr, ranked);
        if (!ranked) continue;
        ASSERT_EQ(g.range.first, h.range.first);
        ASSERT_EQ(g.range.end, std::min<int64_t>(h.head_stride, ranges[row].end));
        ASSERT_EQ(g.range.want, std::min(ranges[row].want, g.range.end - g.range.first));
        ASSERT_EQ(g.range.want, h.range.want);
        const int64_t want = h.range.want;
        for (int64_t kvh = 0; kvh < shape.num_kv_heads; ++kvh) {
          SCOPED_TRACE("KV head " + std::to_string(kvh));
          const float* h_scores = h.data + kvh * h.head_stride;
          auto picks_of = [&](const float* scores) {
            std::vector<int32_t> picked;
            kernels::cpu::TopKIndices(scores + h.range.first, h.range.end - h.range.first, want,
                                      &picked);
            for (int32_t& b : picked) b += static_cast<int32_t>(h.range.first);
            std::sort(picked.begin(), picked.end());
            return picked;
          };
          const std::vector<int32_t> host_top(h.top + kvh * want, h.top + (kvh + 1) * want);
          const std::vector<int32_t> cuda_top(g.top + kvh * want, g.top + (kvh + 1) * want);
          // Each window's picks are the CPU selection's over its own scores.
          ASSERT_EQ(host_top, picks_of(h_scores));
          if (phase == 0) {
            ASSERT_EQ(cuda_top, picks_of(g.data + kvh * g.head_stride));
          } else {
            // The device's scores stayed there: its picks, in order and in range, are as good
            // by the host's scores as the host's own up to the scores' rounding (the two may
            // differ at a near-tie).
            ASSERT_TRUE(std::is_sorted(cuda_top.begin(), cuda_top.end()));
            double host_sum = 0, cuda_sum = 0, slack = 0;
            for (int64_t j = 0; j < want; ++j) {
              ASSERT_GE(cuda_top[j], h.range.first);
              ASSERT_LT(cuda_top[j], h.range.end);
              host_sum += h_scores[host_top[j]];
              cuda_sum += h_scores[cuda_top[j]];
              slack += 2e-4 * (1.0 + std::abs(h_scores[host_top[j]]));
            }
            ASSERT_GE(cuda_sum, host_sum - slack);
          }
          ++ranked_heads;
        }
      }
    }
    for (int64_t& p : positions) ++p;
  }
  EXPECT_GT(compared, 0);
  EXPECT_GT(ranked_heads, 0);
  // 480 + 32 tokens fill the metadata: the third row was scored, then was not.
  EXPECT_EQ(host->block_scores(2).data, nullptr);
  cuda->reset();
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(HeadDimsAndGroups, CudaBlockScoresTest,
                         ::testing::Combine(::testing::Values(32, 64, 128),
                                            ::testing::Values(4, 7)));

// The device selection's picks (SelectRows) against the host window's, which are the CPU's own
// (kernels/cpu/compact_topk.h): equal position for position, over 40 steps of appends from
// admitted compact rows, with pairs asking nothing, zero, one, most or more than their span; a
// third request finds no compact place and a second outgrows the 512-token rows mid-run.
class CudaDevicePicksTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(CudaDevicePicksTest, MatchTheHostWindowsPicksExactly) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto [d, group] = GetParam();
  WindowShape shape;
  shape.num_layers = 2;
  shape.num_kv_heads = 2;
  shape.num_heads = 2 * group;
  shape.head_dim = d;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(d));
  shape.max_requests = 4;
  shape.max_rows = 4;
  shape.page_tokens = 16;
  shape.max_context_tokens = 512;
  shape.compact_slots = 2;
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, d, shape.page_tokens};
  auto arena = *KvArena::Create(kv_shape.page_bytes(), 1024);
  std::mt19937 rng(13);
  const std::vector<int64_t> lengths = {150, 480, 300};
  std::vector<std::unique_ptr<PagedKv>> kvs;
  const int64_t kv_row = shape.num_kv_heads * d, q_row = shape.num_heads * d;
  for (int64_t n : lengths) {
    auto kv = *PagedKv::Create(arena.get(), kv_shape);
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const std::vector<float> k = Random(n * kv_row, rng), v = Random(n * kv_row, rng);
      ASSERT_TRUE(kv->Append(layer, n, k.data(), v.data(), kv_row).ok());
    }
    kvs.push_back(std::move(kv));
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto host = *NewHostResidentWindow(shape, shape.page_tokens);
  const kernels::cpu::CpuPool pool(3);  // outlives the window
  // One head per pinned chunk at admission (the two chunks reused many times).
  auto cuda = NewCudaResidentWindow(shape, stream, /*bounds_chunk_bytes=*/1);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  (*cuda)->set_cpu_pool(&pool);
  std::vector<int> host_slots, cuda_slots;
  for (const auto& kv : kvs) {
    host_slots.push_back(*host->Admit(*kv, 0, /*compact_keys=*/true));
    auto slot = (*cuda)->Admit(*kv, 0, /*compact_keys=*/true);
    ASSERT_TRUE(slot.ok()) << slot.status();
    cuda_slots.push_back(*slot);
  }
  std::vector<int64_t> positions = lengths;
  const int64_t rows = 3;
  DeviceBuffers dev;
  int64_t compared = 0;
  for (int step = 0; step < 40; ++step) {
    ASSERT_TRUE(host->BeginStep(host_slots, positions).ok());
    ASSERT_TRUE((*cuda)->BeginStep(cuda_slots, positions).ok());
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const std::vector<float> q = Random(rows * q_row, rng), k = Random(rows * kv_row, rng);
      std::vector<kernels::CompactPick> asked;
      for (int64_t i = 0; i < rows; ++i) {
        const int32_t end = static_cast<int32_t>(positions[i] + 1 - 64);
        const int32_t ks[] = {-1, 0, 1, end / 3, end - 4, end + 10};
        for (int64_t h = 0; h < shape.num_kv_heads; ++h) {
          asked.push_back({4, end, ks[(step + 2 * i + h + layer) % 6]});
        }
      }
      host->SelectRows(layer, q.data(), k.data(), asked, {});
      (*cuda)->SelectRows(layer, dev.ToDevice(q), dev.ToDevice(k), asked, {});
      ASSERT_TRUE(host->WaitBlockScores().ok());
      ASSERT_TRUE((*cuda)->WaitBlockScores().ok());
      for (int row = 0; row < rows; ++row) {
        SCOPED_TRACE("row " + std::to_string(row) + " step " + std::to_string(step) +
                     " layer " + std::to_string(layer));
        const sparse::ScoredBlocks h = host->block_scores(row), g = (*cuda)->block_scores(row);
        ASSERT_EQ(h.picks != nullptr, g.picks != nullptr);
        if (row == 2) ASSERT_EQ(h.picks, nullptr) << "no compact place left for it";
        if (h.picks == nullptr) continue;
        for (int64_t kvh = 0; kvh < shape.num_kv_heads; ++kvh) {
          ASSERT_EQ(h.pick_count[kvh], g.pick_count[kvh]);
          const std::vector<int32_t> want(h.picks + h.pick_offset[kvh],
                                          h.picks + h.pick_offset[kvh] + h.pick_count[kvh]);
          const std::vector<int32_t> got(g.picks + g.pick_offset[kvh],
                                         g.picks + g.pick_offset[kvh] + g.pick_count[kvh]);
          ASSERT_EQ(got, want) << "KV head " << kvh;
          compared += h.pick_count[kvh];
        }
      }
    }
    ASSERT_TRUE((*cuda)->Sync().ok());
    for (int64_t& p : positions) ++p;
  }
  EXPECT_GT(compared, 0);
  // 480 + 33 tokens outgrow the 512-token rows: row 1 stopped being picked for.
  EXPECT_EQ(host->block_scores(1).picks, nullptr);
  cuda->reset();
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(HeadDimsAndGroups, CudaDevicePicksTest,
                         ::testing::Combine(::testing::Values(32, 64, 128),
                                            ::testing::Values(1, 4, 7)));

TEST(CudaResidentWindowShapeTest, RefusesWhatItCannotHold) {
  WindowShape shape;
  shape.num_layers = 1;
  shape.num_heads = 4;
  shape.num_kv_heads = 1;
  shape.head_dim = 96;  // not 32, 64 or 128
  shape.scale = 0.1f;
  EXPECT_EQ(NewCudaResidentWindow(shape, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  shape.head_dim = 64;
  shape.window_tokens = 300;
  EXPECT_EQ(NewCudaResidentWindow(shape, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}


// ---------------------------------------------------------------------------------------------
// HBM full attention: a whole decode step on the CUDA dense ops with the KV in HBM against the
// same dense ops with attention on the host over bf16 pages (SparseAttention `full`): the same
// bf16 K/V rows and fp32 math on both sides, so logits agree tightly and greedy tokens match.

// Random prompts of `lengths` prefilled on the CPU's dense cache: the caches and each prompt's
// greedy first token.
void Prefill(const model::Model& m, const std::vector<int64_t>& lengths, uint32_t seed,
             std::vector<model::DenseAttention>* caches, std::vector<int32_t>* first) {
  std::mt19937 rng(seed);
  for (int64_t n : lengths) {
    std::vector<int32_t> prompt(n);
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % 256);
    auto dense = std::make_unique<model::DenseAttention>(m.attention_shape());
    model::DenseAttention* raw = dense.get();
    model::Sequence seq(std::move(dense));
    std::vector<float> logits;
    ASSERT_TRUE(m.Forward(seq, prompt, &logits).ok());
    caches->push_back(*raw);
    first->push_back(static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                                          logits.begin()));
  }
}

TEST(HbmFullAttentionTest, WholeStepsMatchHostAttentionOverTheSameBf16Rows) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  model::ModelConfig c = *model::PresetConfig("tiny");
  c.head_dim = 64;  // the CUDA attention kernels take 64 and 128
  const std::string dir = ::testing::TempDir() + "/hbm_full_test_" + std::to_string(getpid());
  ASSERT_TRUE(model::WriteRandomModel(c, 21, dir).ok());
  std::unique_ptr<model::Model> m = std::move(*model::Model::Load(dir));
  std::filesystem::remove_all(dir);
  const model::AttentionShape shape = m->attention_shape();
  const std::vector<int64_t> lengths = {40, 75};
  const int64_t steps = 8, page_tokens = 16;

  // CPU prefills; their caches feed both sides.
  std::vector<model::DenseAttention> prefills;
  std::vector<int32_t> first;
  Prefill(*m, lengths, 5, &prefills, &first);

  auto ops = model::NewCudaDenseOps(0);
  ASSERT_TRUE(ops.ok()) << ops.status();
  auto runner = model::DecodeStepRunner::Create(*m, ops->get());
  ASSERT_TRUE(runner.ok()) << runner.status();
  const int64_t vocab = c.vocab_size, rows = static_cast<int64_t>(lengths.size());

  // Host side: full attention over bf16 pages, q/k/v copied from the device each layer.
  auto arena = *KvArena::Create(
      KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, page_tokens}.page_bytes(),
      1024);
  std::vector<std::unique_ptr<model::Sequence>> seqs;
  std::vector<model::Sequence*> ptrs;
  for (size_t i = 0; i < prefills.size(); ++i) {
    auto a = SparseAttention::FromDense(arena.get(), shape, page_tokens, prefills[i],
                                        *sparse::ParsePolicy("full", 1.0));
    ASSERT_TRUE(a.ok()) << a.status();
    seqs.push_back(std::make_unique<model::Sequence>(std::move(*a), lengths[i]));
    ptrs.push_back(seqs.back().get());
  }
  model::SequenceBatchAttention host(ptrs, shape, ops->get());

  // Device side.
  HbmKvShape hs;
  hs.num_layers = shape.num_layers;
  hs.num_heads = shape.num_heads;
  hs.num_kv_heads = shape.num_kv_heads;
  hs.head_dim = shape.head_dim;
  hs.scale = shape.scale;
  hs.page_tokens = page_tokens;
  hs.max_requests = rows;
  hs.max_tokens = 128;
  auto hbm = HbmFullAttention::Create(
      hs, static_cast<cudaStream_t>((*ops)->native_stream()),
      kernels::cuda::PagedKernel::kV5);
  ASSERT_TRUE(hbm.ok()) << hbm.status();
  for (int64_t i = 0; i < rows; ++i) {
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      ASSERT_TRUE((*hbm)->LoadTokens(static_cast<int>(i), layer, lengths[i],
                                     prefills[i].keys(layer), prefills[i].values(layer))
                      .ok());
    }
  }

  std::vector<int32_t> host_tokens = first, hbm_tokens = first;
  std::vector<int64_t> positions = lengths;
  const std::vector<int> slots = {0, 1};
  std::vector<float> host_logits(rows * vocab), hbm_logits(rows * vocab);
  for (int64_t s = 0; s < steps; ++s) {
    ASSERT_TRUE((*runner)->Step(host_tokens, positions, host, host_logits.data()).ok());
    ASSERT_TRUE((*hbm)->BeginStep(slots, positions).ok());
    ASSERT_TRUE((*runner)->Step(hbm_tokens, positions, **hbm, hbm_logits.data()).ok());
    float worst = 0, scale = 0;
    for (int64_t j = 0; j < rows * vocab; ++j) {
      worst = std::max(worst, std::abs(host_logits[j] - hbm_logits[j]));
      scale = std::max(scale, std::abs(host_logits[j]));
    }
    EXPECT_LT(worst, kBf16StepTolerance * std::max(scale, 1.0f)) << "step " << s;
    for (int64_t i = 0; i < rows; ++i) {
      const float* h = host_logits.data() + i * vocab;
      const float* g = hbm_logits.data() + i * vocab;
      host_tokens[i] = static_cast<int32_t>(std::max_element(h, h + vocab) - h);
      hbm_tokens[i] = static_cast<int32_t>(std::max_element(g, g + vocab) - g);
      if (!NearTie(h, vocab, 2 * worst)) {
        EXPECT_EQ(host_tokens[i], hbm_tokens[i]) << "request " << i << " step " << s;
      }
      hbm_tokens[i] = host_tokens[i];  // both sides continue from the same token
      ++positions[i];
    }
  }
}


// The hybrid step on the GPU (CUDA dense ops + the CUDA resident window + the CPU over host
// pages) against the same dense ops with each request's attention on the host
// (SequenceBatchAttention over SparseAttention): the same plans attended in another merge order.
TEST(HybridOnCudaTest, StepsMatchHostAttentionForEveryScoringAndReadSplit) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  model::ModelConfig c = *model::PresetConfig("tiny");
  c.head_dim = 64;
  const std::string dir = ::testing::TempDir() + "/hybrid_cuda_test_" + std::to_string(getpid());
  ASSERT_TRUE(model::WriteRandomModel(c, 23, dir).ok());
  std::unique_ptr<model::Model> m = std::move(*model::Model::Load(dir));
  std::filesystem::remove_all(dir);
  const model::AttentionShape shape = m->attention_shape();
  const std::vector<int64_t> lengths = {300, 150, 90};
  const int64_t steps = 8, page_tokens = 16, vocab = c.vocab_size;
  std::vector<model::DenseAttention> prefills;
  std::vector<int32_t> first;
  Prefill(*m, lengths, 9, &prefills, &first);
  // max_context > 0: the window also keeps page bounds and scores quest's / fixed_*'s blocks on
  // the device (near-equal scores may pick other blocks of equal count: near-ties are excused).
  // share > 0: the GPU reads that share of every pair's host rows from the pinned arena.
  struct Case {
    const char* name;
    int64_t max_context;
    double share;
  };
  // (fixed_32_0.5: at 0.3 a 300-token context leaves fewer middle rows than one 32-token block.)
  const Case cases[] = {{"full", 0, 0},         {"quest", 0, 0},       {"quest", 512, 0},
                        {"fixed_32_0.5", 512, 0}, {"full", 0, 0.5},    {"quest", 512, 0.4},
                        {"fixed_32_0.5", 512, 1.0}};
  for (const auto& [name, max_context, share] : cases) {
    SCOPED_TRACE(std::string(name) + " max_context " + std::to_string(max_context) + " share " +
                 std::to_string(share));
    const sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.3);
    auto arena = *KvArena::Create(
        KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, page_tokens}.page_bytes(),
        4096);
    if (share > 0) ASSERT_TRUE(PinArenaForCuda(arena.get()).ok());
    auto make = [&](std::vector<std::unique_ptr<model::Sequence>>* seqs,
                    std::vector<SparseAttention*>* attentions) {
      for (size_t i = 0; i < prefills.size(); ++i) {
        auto a = SparseAttention::FromDense(arena.get(), shape, page_tokens, prefills[i], policy);
        ASSERT_TRUE(a.ok()) << a.status();
        attentions->push_back(a->get());
        seqs->push_back(std::make_unique<model::Sequence>(std::move(*a), lengths[i]));
      }
    };
    // Reference: CUDA dense ops, attention per request on the host.
    std::vector<std::unique_ptr<model::Sequence>> ref_seqs;
    std::vector<SparseAttention*> ref_attn;
    make(&ref_seqs, &ref_attn);
    std::vector<model::Sequence*> ref_ptrs;
    for (auto& q : ref_seqs) ref_ptrs.push_back(q.get());
    auto ref_ops = model::NewCudaDenseOps(0);
    ASSERT_TRUE(ref_ops.ok()) << ref_ops.status();
    auto ref_runner = model::DecodeStepRunner::Create(*m, ref_ops->get());
    ASSERT_TRUE(ref_runner.ok());
    model::SequenceBatchAttention host(ref_ptrs, shape, ref_ops->get());
    // The hybrid executor on the GPU.
    std::vector<std::unique_ptr<model::Sequence>> seqs;
    std::vector<SparseAttention*> attentions;
    make(&seqs, &attentions);
    auto ops = model::NewCudaDenseOps(0);
    ASSERT_TRUE(ops.ok());
    WindowShape w = WindowShapeFor(shape, 4);
    w.page_tokens = page_tokens;
    w.max_context_tokens = max_context;
    auto window = NewCudaResidentWindow(w, static_cast<cudaStream_t>((*ops)->native_stream()));
    ASSERT_TRUE(window.ok()) << window.status();
    auto hybrid = HybridStepExecutor::Create(m.get(), std::move(*ops), std::move(*window), nullptr);
    ASSERT_TRUE(hybrid.ok()) << hybrid.status();
    (*hybrid)->set_device_read_share(share);

    std::vector<int32_t> ref_tokens = first;
    std::vector<StepRequest> batch;
    for (size_t i = 0; i < seqs.size(); ++i) batch.push_back({seqs[i].get(), attentions[i], first[i]});
    std::vector<float> ref_logits(lengths.size() * vocab), logits;
    std::vector<absl::Status> statuses;
    for (int64_t s = 0; s < steps; ++s) {
      std::vector<int64_t> positions;
      for (auto* q : ref_ptrs) positions.push_back(q->length());
      ASSERT_TRUE((*ref_runner)->Step(ref_tokens, positions, host, ref_logits.data()).ok());
      (*hybrid)->Step(batch, &logits, &statuses);
      for (const absl::Status& st : statuses) ASSERT_TRUE(st.ok()) << st;
      float worst = 0, scale = 0;
      for (size_t j = 0; j < ref_logits.size(); ++j) {
        worst = std::max(worst, std::abs(ref_logits[j] - logits[j]));
        scale = std::max(scale, std::abs(ref_logits[j]));
      }
      EXPECT_LT(worst, kBf16StepTolerance * std::max(scale, 1.0f)) << "step " << s;
      for (size_t i = 0; i < batch.size(); ++i) {
        const float* r = ref_logits.data() + i * vocab;
        const float* g = logits.data() + i * vocab;
        ref_tokens[i] = static_cast<int32_t>(std::max_element(r, r + vocab) - r);
        batch[i].token = static_cast<int32_t>(std::max_element(g, g + vocab) - g);
        if (!NearTie(r, vocab, 2 * worst)) {
          EXPECT_EQ(ref_tokens[i], batch[i].token) << "request " << i << " step " << s;
        }
        batch[i].token = ref_tokens[i];  // both sides continue from the same token
      }
    }
    if (share < 1.0) EXPECT_GT((*hybrid)->counters().host_rows, 0);
    if (share > 0) EXPECT_GT((*hybrid)->counters().mapped_rows, 0);
    if (share == 1.0) EXPECT_EQ((*hybrid)->counters().host_rows, 0);
    int64_t scored_elsewhere = 0, ranked_elsewhere = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_EQ(attentions[i]->stats().rows_attended, ref_attn[i]->stats().rows_attended);
      scored_elsewhere += attentions[i]->stats().blocks_scored_elsewhere;
      ranked_elsewhere += attentions[i]->stats().selections_ranked_elsewhere;
      // Shorter contexts leave no middle block to pick (nothing scored at all), so per request
      // only this holds: nothing scanned on the CPU.
      if (max_context > 0) EXPECT_EQ(attentions[i]->stats().metadata_bytes, 0) << "request " << i;
    }
    if (max_context > 0) EXPECT_GT(scored_elsewhere, 0);
    // quest and fixed_* take the device's picks (TopBlocks) whenever it scored their blocks.
    if (max_context > 0) EXPECT_GT(ranked_elsewhere, 0);
  }
}

// The ping-pong executor on the GPU (two pipelines on two streams, one copy of the weights, two
// driver threads) against the single-pipeline CUDA executor on the same batch: the same plans, the
// halves' dense products over fewer rows (cuBLAS may pick another algorithm per row count), so
// within the bf16 step tolerance, and the same greedy tokens unless a near-tie.
TEST(HybridOnCudaTest, PingPongMatchesTheSinglePipeline) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  model::ModelConfig c = *model::PresetConfig("tiny");
  c.head_dim = 64;
  const std::string dir = ::testing::TempDir() + "/ping_pong_cuda_test_" + std::to_string(getpid());
  ASSERT_TRUE(model::WriteRandomModel(c, 29, dir).ok());
  std::unique_ptr<model::Model> m = std::move(*model::Model::Load(dir));
  std::filesystem::remove_all(dir);
  const model::AttentionShape shape = m->attention_shape();
  const std::vector<int64_t> lengths = {300, 150, 90, 220, 400};
  const int64_t steps = 6, page_tokens = 16, vocab = c.vocab_size;
  std::vector<model::DenseAttention> prefills;
  std::vector<int32_t> first;
  Prefill(*m, lengths, 13, &prefills, &first);
  const kernels::cpu::CpuPool pool(2);
  for (const char* name : {"full", "quest", "fixed_32_0.5"}) {
    for (double share : {0.0, 0.5}) {
      SCOPED_TRACE(std::string(name) + " share " + std::to_string(share));
      const sparse::PolicyConfig policy = *sparse::ParsePolicy(name, 0.3);
      auto arena = *KvArena::Create(
          KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, page_tokens}.page_bytes(),
          8192);
      if (share > 0) {
        ASSERT_TRUE(PinArenaForCuda(arena.get()).ok());
      }
      auto make = [&](std::vector<std::unique_ptr<model::Sequence>>* seqs,
                      std::vector<StepRequest>* batch) {
        for (size_t i = 0; i < prefills.size(); ++i) {
          auto a = SparseAttention::FromDense(arena.get(), shape, page_tokens, prefills[i], policy);
          ASSERT_TRUE(a.ok()) << a.status();
          SparseAttention* raw = a->get();
          seqs->push_back(std::make_unique<model::Sequence>(std::move(*a), lengths[i]));
          batch->push_back({seqs->back().get(), raw, first[i]});
        }
      };
      StepExecutorOptions options;
      options.device = StepDevice::kCuda;
      options.cuda.max_requests = 8;
      options.cuda.max_context_tokens = 1024;
      options.cuda.page_tokens = page_tokens;
      options.cuda.device_read_share = share;
      options.cuda.micro_batches = 1;
      // The arena is pinned above (or not, at share 0): the factory is given none to pin.
      auto single = NewStepExecutor(m.get(), &pool, nullptr, options);
      ASSERT_TRUE(single.ok()) << single.status();
      options.cuda.micro_batches = 2;
      auto ping_pong = NewStepExecutor(m.get(), &pool, nullptr, options);
      ASSERT_TRUE(ping_pong.ok()) << ping_pong.status();
      EXPECT_EQ((*ping_pong)->name(), "ping-pong");
      EXPECT_EQ((*ping_pong)->max_batch(), 8);
      std::vector<std::unique_ptr<model::Sequence>> ref_seqs, seqs;
      std::vector<StepRequest> ref_batch, batch;
      make(&ref_seqs, &ref_batch);
      make(&seqs, &batch);
      std::vector<float> ref_logits, logits;
      std::vector<absl::Status> statuses;
      for (int64_t s = 0; s < steps; ++s) {
        // A request leaves after step 2 (its micro-batch goes on with one fewer).
        if (s == 3) {
          ref_batch.pop_back();
          batch.pop_back();
        }
        (*single)->Step(ref_batch, &ref_logits, &statuses);
        for (const absl::Status& st : statuses) ASSERT_TRUE(st.ok()) << st;
        (*ping_pong)->Step(batch, &logits, &statuses);
        for (const absl::Status& st : statuses) ASSERT_TRUE(st.ok()) << st;
        ASSERT_EQ(logits.size(), ref_logits.size());
        float worst = 0, scale = 0;
        for (size_t j = 0; j < ref_logits.size(); ++j) {
          worst = std::max(worst, std::abs(ref_logits[j] - logits[j]));
          scale = std::max(scale, std::abs(ref_logits[j]));
        }
        EXPECT_LT(worst, kBf16StepTolerance * std::max(scale, 1.0f)) << "step " << s;
        for (size_t i = 0; i < batch.size(); ++i) {
          const float* r = ref_logits.data() + i * vocab;
          const float* g = logits.data() + i * vocab;
          const int32_t ref_token = static_cast<int32_t>(std::max_element(r, r + vocab) - r);
          const int32_t token = static_cast<int32_t>(std::max_element(g, g + vocab) - g);
          if (!NearTie(r, vocab, 2 * worst)) {
            EXPECT_EQ(ref_token, token) << "request " << i << " step " << s;
          }
          ref_batch[i].token = batch[i].token = ref_token;  // both continue from the same token
        }
      }
      for (size_t i = 0; i < batch.size(); ++i) {
        EXPECT_EQ(batch[i].attention->stats().rows_attended,
                  ref_batch[i].attention->stats().rows_attended)
            << "request " << i;
      }
    }
  }
}

}  // namespace
}  // namespace fluxion::decode
