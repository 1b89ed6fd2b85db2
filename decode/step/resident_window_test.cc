// The host ResidentWindow's selection metadata: the block scores it gives each step equal, bit for
// bit, the CPU policy's scan over the request's own page metadata after the same appends
// (kernels::cpu::QuestBlockBounds over PagedKv::key_min / key_max), for decodes long enough that
// every page folded from step K is scored many times, also after steps that asked for no scores;
// a request whose context outgrows the window's metadata stops being scored; bad block sizes are
// refused.
#include "decode/step/resident_window.h"

#include <random>
#include <vector>

#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
#include "gtest/gtest.h"
#include "kernels/cpu/selection.h"

namespace fluxion::decode {
namespace {

constexpr int64_t kPageTokens = 16;

std::vector<float> Random(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

WindowShape TestShape() {
  WindowShape w;
  w.num_layers = 2;
  w.num_heads = 8;
  w.num_kv_heads = 2;
  w.head_dim = 64;
  w.scale = 0.125f;
  w.max_requests = 4;
  w.max_rows = 4;
  w.page_tokens = kPageTokens;
  w.max_context_tokens = 512;
  return w;
}

struct Fixture {
  WindowShape shape = TestShape();
  std::unique_ptr<KvArena> arena;
  std::vector<std::unique_ptr<PagedKv>> kvs;

  explicit Fixture(const std::vector<int64_t>& lengths, std::mt19937& rng) {
    const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens};
    arena = *KvArena::Create(kv_shape.page_bytes(), 1024);
    const int64_t row = shape.num_kv_heads * shape.head_dim;
    for (int64_t n : lengths) {
      auto kv = *PagedKv::Create(arena.get(), kv_shape);
      for (int layer = 0; layer < shape.num_layers; ++layer) {
        const std::vector<float> k = Random(n * row, rng), v = Random(n * row, rng);
        EXPECT_TRUE(kv->Append(layer, n, k.data(), v.data(), row).ok());
      }
      kvs.push_back(std::move(kv));
    }
  }
};

TEST(HostResidentWindowTest, BlockScoresEqualTheCpuScanOfThePagesAfterEveryAppend) {
  std::mt19937 rng(7);
  // 500 + 12 tokens fill the 512-token metadata: from the 13th step on that row is not scored.
  Fixture f({40, 150, 500}, rng);
  const std::vector<int64_t> blocks = {32, 16, 64};
  auto window = *NewHostResidentWindow(f.shape, kPageTokens);
  std::vector<int> slots;
  for (size_t i = 0; i < f.kvs.size(); ++i) slots.push_back(*window->Admit(*f.kvs[i], blocks[i], false));
  const WindowShape& w = f.shape;
  const int64_t d = w.head_dim, group = w.num_heads / w.num_kv_heads, rows = 3;
  const int64_t kv_row = w.num_kv_heads * d;
  for (int step = 0; step < 100; ++step) {
    std::vector<int64_t> positions;
    for (const auto& kv : f.kvs) positions.push_back(kv->length(0));
    // Row 0 asks for scores on even steps only: its bounds must follow on the others too.
    const std::vector<uint8_t> score = {static_cast<uint8_t>(step % 2 == 0), 1, 1};
    ASSERT_TRUE(window->BeginStep(slots, positions, score).ok());
    for (int layer = 0; layer < w.num_layers; ++layer) {
      const std::vector<float> q = Random(rows * w.num_heads * d, rng);
      const std::vector<float> k = Random(rows * kv_row, rng), v = Random(rows * kv_row, rng);
      window->ScoreBlocks(layer, q.data(), k.data());
      ASSERT_TRUE(window->WaitBlockScores().ok());
      for (int64_t i = 0; i < rows; ++i) {
        PagedKv& kv = *f.kvs[i];
        ASSERT_TRUE(kv.Append(layer, 1, k.data() + i * kv_row, v.data() + i * kv_row, kv_row).ok());
        const sparse::ScoredBlocks got = window->block_scores(static_cast<int>(i));
        const int64_t context = positions[i] + 1;
        if (context > w.max_context_tokens || !score[i]) {
          EXPECT_EQ(got.data, nullptr) << "row " << i << " step " << step;
          continue;
        }
        ASSERT_NE(got.data, nullptr) << "row " << i << " step " << step;
        const int64_t nb = (context + blocks[i] - 1) / blocks[i];
        ASSERT_EQ(got.block_tokens, blocks[i]);
        ASSERT_EQ(got.head_stride, nb);
        // The CPU scan reads whole blocks of existing pages (the policy never scores a trailing
        // block past the pages: it stops before the local window).
        const int64_t ppb = blocks[i] / kPageTokens;
        const int64_t whole = (context + kPageTokens - 1) / kPageTokens / ppb;
        std::vector<float> want(nb);
        for (int h = 0; h < w.num_kv_heads; ++h) {
          kernels::cpu::QuestBlockBounds(kv.key_min(layer, h), kv.key_max(layer, h), d, 0, whole,
                                         ppb, q.data() + (i * w.num_heads + h * group) * d, group,
                                         want.data());
          for (int64_t b = 0; b < whole; ++b) {
            ASSERT_EQ(got.data[h * nb + b], want[b])
                << "row " << i << " step " << step << " layer " << layer << " head " << h
                << " block " << b;
          }
        }
      }
    }
  }
}

TEST(HostResidentWindowTest, AdmissionChecksTheScoreBlock) {
  std::mt19937 rng(8);
  Fixture f({40}, rng);
  auto window = *NewHostResidentWindow(f.shape, kPageTokens);
  EXPECT_EQ(window->Admit(*f.kvs[0], 24, false).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(window->Admit(*f.kvs[0], -16, false).status().code(), absl::StatusCode::kInvalidArgument);
  // A window without metadata takes the request and never scores it.
  WindowShape plain = f.shape;
  plain.max_context_tokens = 0;
  auto unscored = *NewHostResidentWindow(plain, kPageTokens);
  const int slot = *unscored->Admit(*f.kvs[0], 32, false);
  ASSERT_TRUE(unscored->BeginStep({slot}, {40}).ok());
  std::mt19937 r2(9);
  const std::vector<float> q = Random(8 * 64, r2), k = Random(2 * 64, r2);
  unscored->ScoreBlocks(0, q.data(), k.data());
  ASSERT_TRUE(unscored->WaitBlockScores().ok());
  EXPECT_EQ(unscored->block_scores(0).data, nullptr);
}

}  // namespace
}  // namespace fluxion::decode
