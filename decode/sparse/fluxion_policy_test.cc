#include "decode/sparse/fluxion_policy.h"

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace fluxion::decode::sparse {
namespace {

// The sparse state a prefill would capture for one layer of two KV heads (one query head each)
// whose last 32 queries all point along `q_dir`.
absl::StatusOr<model::SparseState> CaptureTail(const std::vector<float>& k, int64_t tokens,
                                               const std::vector<float>& q_dir) {
  const int64_t d = static_cast<int64_t>(q_dir.size());
  std::vector<float> tail_q;
  std::vector<int64_t> tail_pos;
  for (int64_t i = tokens - 32; i < tokens; ++i) {
    tail_pos.push_back(i);
    for (int h = 0; h < 2; ++h) tail_q.insert(tail_q.end(), q_dir.begin(), q_dir.end());
  }
  const model::AttentionShape attn{1, 2, 2, d, 1.0f / std::sqrt(static_cast<float>(d))};
  return model::CaptureSparseState({k.data()}, tokens, {tail_q}, {tail_pos}, attn);
}

// Random keys (small), values and a query direction for two KV heads over `tokens` positions,
// [tokens][2][d]; tests then align chosen keys with `q_dir`.
struct TwoHeadPrompt {
  std::vector<float> q_dir, k, v;
};
TwoHeadPrompt RandomTwoHeadPrompt(int64_t tokens, int64_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  TwoHeadPrompt p{std::vector<float>(d), std::vector<float>(tokens * 2 * d),
                  std::vector<float>(tokens * 2 * d)};
  for (float& x : p.q_dir) x = normal(rng);
  for (float& x : p.k) x = normal(rng) * 0.3f;
  for (float& x : p.v) x = normal(rng);
  return p;
}

// An arena and an empty paged sequence for one layer of two KV heads of `tokens` positions
// (kv is declared after the arena, so it is destroyed first).
struct TwoHeadKv {
  TwoHeadKv(int64_t tokens, int64_t d)
      : arena(*KvArena::Create(KvShape{1, 2, d, 16}.page_bytes(), 2 * (tokens / 16 + 2))),
        kv(*PagedKv::Create(arena.get(), KvShape{1, 2, d, 16})) {}
  std::unique_ptr<KvArena> arena;
  std::unique_ptr<PagedKv> kv;
};

// Two KV heads, one query head each: head 0 is a streaming head (every query is drawn to the
// sinks), head 1 a diffuse one. Fluxion must give head 0 no middle budget and head 1 the rest,
// keeping the request's total read at the uniform budget.
TEST(FluxionPolicyTest, StreamingHeadGetsNoMiddleBudgetAndTotalReadIsKept) {
  const int64_t tokens = 2048, d = 32;
  TwoHeadKv pool(tokens, d);
  auto& kv = pool.kv;
  auto [q_dir, k, v] = RandomTwoHeadPrompt(tokens, d, 3);
  for (int64_t t = 0; t < 4; ++t) {
    for (int64_t j = 0; j < d; ++j) k[(t * 2 + 0) * d + j] = 4.0f * q_dir[j];  // head 0 sinks
  }
  ASSERT_TRUE(kv->Append(0, tokens, k.data(), v.data(), 2 * d).ok());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const absl::StatusOr<model::SparseState> state = CaptureTail(k, tokens, q_dir);
  ASSERT_TRUE(state.ok()) << state.status();
  PolicyConfig config = *ParsePolicy("fluxion", 0.1);
  FluxionPolicy policy(config, nullptr);
  for (int h = 0; h < 2; ++h) {
    ASSERT_TRUE(policy.Prepare(*kv, 0, h, &state->head(0, h)).ok());
  }
  SelectionStats stats[2];
  for (int h = 0; h < 2; ++h) {
    std::vector<kernels::PageSpan> spans;
    policy.Select({kv.get(), 0, h, q_dir.data(), 1, scale, tokens}, &spans, &stats[h]);
  }
  const int64_t sinks_and_window = 4 + 64;
  EXPECT_EQ(stats[0].rows_attended, sinks_and_window);  // streaming: nothing from the middle
  // The uniform budget per head is 0.1 * 2048 = 205 rows; head 1 gets head 0's middle share too.
  const int64_t uniform_middle = static_cast<int64_t>(std::ceil(0.1 * tokens)) - sinks_and_window;
  EXPECT_NEAR(stats[1].rows_attended - sinks_and_window, 2 * uniform_middle, 2);
}

// Granularity (granularity.h) inside the policy: a head whose prefill attention sits in one long
// run of keys scans 64-token blocks (as well covered, cheaper); a head whose attention is spread
// over 200 single keys keeps 16-token blocks (coarser top blocks would hold far fewer of them).
TEST(FluxionPolicyTest, RunsOfAttentionGetCoarseBlocksScatteredAttentionFineOnes) {
  const int64_t tokens = 16384, d = 32;
  TwoHeadKv pool(tokens, d);
  auto& kv = pool.kv;
  auto [q_dir, k, v] = RandomTwoHeadPrompt(tokens, d, 5);
  auto align = [&](int64_t t, int h) {
    for (int64_t j = 0; j < d; ++j) k[(t * 2 + h) * d + j] = 1.5f * q_dir[j];
  };
  for (int64_t t = 5000; t < 6000; ++t) align(t, 0);       // head 0: one run of 1,000 keys
  for (int64_t i = 0; i < 200; ++i) align(100 + 80 * i, 1);  // head 1: 200 keys, 80 apart
  ASSERT_TRUE(kv->Append(0, tokens, k.data(), v.data(), 2 * d).ok());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const absl::StatusOr<model::SparseState> state = CaptureTail(k, tokens, q_dir);
  ASSERT_TRUE(state.ok()) << state.status();
  FluxionPolicy policy(*ParsePolicy("fluxion", 0.05), nullptr);
  for (int h = 0; h < 2; ++h) {
    ASSERT_TRUE(policy.Prepare(*kv, 0, h, &state->head(0, h)).ok());
  }
  for (int h = 0; h < 2; ++h) {
    std::vector<kernels::PageSpan> spans;
    SelectionStats stats;
    policy.Select({kv.get(), 0, h, q_dir.data(), 1, scale, tokens}, &spans, &stats);
    EXPECT_EQ(stats.bypassed, 0) << "head " << h;
    EXPECT_GT(stats.metadata_bytes, 0) << "head " << h << " did not scan block bounds";
  }
  EXPECT_EQ(policy.HeadBlock(0, 0), 64);
  EXPECT_EQ(policy.HeadBlock(0, 1), 16);
}

}  // namespace
}  // namespace fluxion::decode::sparse
