#include "decode/step/sparse_attention.h"

#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/reference/reference_ops.h"
#include "kernels/reference/compare.h"

namespace fluxion::decode {
namespace {

constexpr model::AttentionShape kShape{1, 8, 2, 64, 0.125f};

std::vector<float> Random(size_t n, std::mt19937* rng, float sd = 1.0f) {
  std::normal_distribution<float> normal(0, sd);
  std::vector<float> v(n);
  for (float& x : v) x = normal(*rng);
  return v;
}

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  return kernels::reference::RelativeL2Error(got, want);
}

// A prefilled dense state of `tokens` random K/V rows plus one decode query.
struct Setup {
  model::DenseAttention dense{kShape};
  std::vector<float> q_step, k_step, v_step;
  std::vector<float> k_all, v_all;  // every row incl. the step's, bf16-rounded
};

std::unique_ptr<Setup> MakeSetup(int64_t tokens, uint32_t seed, int64_t needle = -1) {
  auto s = std::make_unique<Setup>();
  std::mt19937 rng(seed);
  const int64_t row = kShape.num_kv_heads * kShape.head_dim;
  auto q = Random(tokens * kShape.num_heads * kShape.head_dim, &rng);
  auto k = Random(tokens * row, &rng), v = Random(tokens * row, &rng);
  s->q_step = Random(kShape.num_heads * kShape.head_dim, &rng);
  s->k_step = Random(row, &rng);
  s->v_step = Random(row, &rng);
  if (needle >= 0) {
    // A key aligned with every query of KV head 0: the row a sparse policy must not miss.
    for (int64_t j = 0; j < kShape.head_dim; ++j) k[needle * row + j] = 3.0f * s->q_step[j];
  }
  std::vector<float> out(q.size());
  EXPECT_TRUE(s->dense.Forward(0, 0, tokens, q.data(), k.data(), v.data(), out.data()).ok());
  s->k_all = k;
  s->v_all = v;
  s->k_all.insert(s->k_all.end(), s->k_step.begin(), s->k_step.end());
  s->v_all.insert(s->v_all.end(), s->v_step.begin(), s->v_step.end());
  for (auto* vec : {&s->k_all, &s->v_all})
    for (float& x : *vec) x = RoundToBf16(x);
  return s;
}

std::vector<float> FullReference(const Setup& s, int64_t tokens) {
  std::vector<float> want(s.q_step.size());
  kernels::reference::CausalAttention(s.q_step.data(), s.k_all.data(), s.v_all.data(), want.data(),
                                      {1, tokens, kShape.num_heads, kShape.num_kv_heads,
                                       kShape.head_dim, kShape.scale});
  return want;
}

std::vector<float> Step(SparseAttention& a, const Setup& s, int64_t tokens) {
  std::vector<float> out(s.q_step.size());
  EXPECT_TRUE(a.Forward(0, tokens, 1, s.q_step.data(), s.k_step.data(), s.v_step.data(),
                        out.data())
                  .ok());
  return out;
}

TEST(SparseAttentionTest, FullPolicyMatchesDenseAttentionOverTheSameBf16Rows) {
  const int64_t tokens = 300;
  auto s = MakeSetup(tokens, 1);
  auto arena = *KvArena::Create(KvShape{1, 2, 64, 16}.page_bytes(), 128);
  auto a = SparseAttention::FromDense(arena.get(), kShape, 16, s->dense,
                                      *sparse::ParsePolicy("full", 1.0));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_LT(RelErr(Step(**a, *s, tokens), FullReference(*s, tokens)), 1e-5);
  EXPECT_DOUBLE_EQ((*a)->attended_fraction(), 1.0);
}

TEST(SparseAttentionTest, EveryPolicySpendsItsBudgetAndFindsAPlantedNeedle) {
  const int64_t tokens = 4096, needle = 1717;
  auto s = MakeSetup(tokens, 2, needle);
  const auto want = FullReference(*s, tokens);
  auto arena = *KvArena::Create(KvShape{1, 2, 64, 16}.page_bytes(), 1024);
  for (const char* name : {"exact_topk", "quest", "fixed_32_0.05", "lfps", "lfps_paper", "fluxion"}) {
    auto a = SparseAttention::FromDense(arena.get(), kShape, 16, s->dense,
                                        *sparse::ParsePolicy(name, 0.05));
    ASSERT_TRUE(a.ok()) << a.status();
    const auto got = Step(**a, *s, tokens);
    EXPECT_NEAR((*a)->attended_fraction(), 0.05, 0.005) << name;
    // The needle dominates query head 0's attention (its key is aligned with that query), so
    // head 0's output must match full attention closely; the other heads see diffuse random
    // scores, where any 5% selection is far off.
    std::vector<float> got0(got.begin(), got.begin() + 64), want0(want.begin(), want.begin() + 64);
    EXPECT_LT(RelErr(got0, want0), 0.05) << name;
  }
  EXPECT_EQ(arena->counters().reserved, 0);  // every sequence returned its pages
}

TEST(SparseAttentionTest, LfpsKeepsFindingTheNeedleFromItsTablesWithoutFullScans) {
  const int64_t tokens = 4096, needle = 1717;
  auto s = MakeSetup(tokens, 5, needle);
  auto arena = *KvArena::Create(KvShape{1, 2, 64, 16}.page_bytes(), 1024);
  auto a = *SparseAttention::FromDense(arena.get(), kShape, 16, s->dense,
                                       *sparse::ParsePolicy("lfps", 0.05));
  std::vector<float> out(s->q_step.size());
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0, 1);
  int64_t scored_before = 0;
  for (int step = 0; step < 12; ++step) {
    const int64_t pos = tokens + step;
    std::vector<float> k(2 * 64), v(2 * 64);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    ASSERT_TRUE(a->Forward(0, pos, 1, s->q_step.data(), k.data(), v.data(), out.data()).ok());
    // Query head 0 is aligned with the needle: its output is close to the needle's value row.
    std::vector<float> needle_v(s->v_all.begin() + needle * 128, s->v_all.begin() + needle * 128 + 64);
    std::vector<float> got0(out.begin(), out.begin() + 64);
    EXPECT_LT(RelErr(got0, needle_v), 0.1) << "step " << step;
    const int64_t scored = a->stats().k_rows_scored - scored_before;
    scored_before = a->stats().k_rows_scored;
    // Step 0 refreshes (exact scan of both KV heads' middle regions); later steps score only
    // table candidates, a small fraction of the context.
    if (step > 0) {
      EXPECT_LT(scored, tokens / 2) << "step " << step;
    }
  }
}

TEST(SparseAttentionTest, BudgetBelowSinksAndWindowAttendsExactlySinksAndWindow) {
  const int64_t tokens = 2000;
  auto s = MakeSetup(tokens, 3);
  auto arena = *KvArena::Create(KvShape{1, 2, 64, 16}.page_bytes(), 512);
  auto a = *SparseAttention::FromDense(arena.get(), kShape, 16, s->dense,
                                       *sparse::ParsePolicy("quest", 0.01));
  Step(*a, *s, tokens);
  EXPECT_EQ(a->stats().rows_attended, 2 * (4 + 64));  // per KV head: 4 sinks + 64 local
}

// The hybrid step's deferred observation (CompleteUnit now, ObservePending beside the next
// layer's selections, with PrepareNextStep's table picks) against FinishUnit at once: the same
// rows every step, layer and head, the same outputs, and most table picks made a step ahead.
// Three layers, so a step's last layer (2) and its next first (0) share a scratch parity:
// AppendToken must end that pending observation itself. A step at half the budget makes the
// picks prepared for it and after it miss (made for another budget): they are made again.
TEST(SparseAttentionTest, DeferredObservationSelectsWhatImmediateObservationSelects) {
  constexpr model::AttentionShape shape{3, 8, 2, 64, 0.125f};
  const int64_t tokens = 2048, steps = 10, row = 2 * 64, q_row = 8 * 64;
  std::mt19937 rng(11);
  model::DenseAttention dense(shape);
  dense.RecordQueries(tokens - 32, tokens);
  for (int layer = 0; layer < 3; ++layer) {
    auto q = Random(tokens * q_row, &rng), k = Random(tokens * row, &rng);
    auto v = Random(tokens * row, &rng);
    std::vector<float> out(q.size());
    ASSERT_TRUE(dense.Forward(layer, 0, tokens, q.data(), k.data(), v.data(), out.data()).ok());
  }
  // [step][layer]: the decode inputs.
  std::vector<std::vector<std::vector<float>>> q(steps), k(steps), v(steps);
  for (int64_t st = 0; st < steps; ++st) {
    for (int layer = 0; layer < 3; ++layer) {
      q[st].push_back(Random(q_row, &rng));
      k[st].push_back(Random(row, &rng));
      v[st].push_back(Random(row, &rng));
    }
  }
  const double scales[steps] = {1, 1, 1, 1, 0.5, 1, 1, 1, 1, 1};
  auto arena = *KvArena::Create(KvShape{3, 2, 64, 16}.page_bytes(), 1024);
  for (const char* name : {"lfps", "fluxion"}) {
    struct Run {
      std::vector<std::vector<kernels::PageSpan>> spans;  // [step * 3 * 2 + layer * 2 + head]
      std::vector<float> out;
      sparse::SelectionStats stats;
    };
    auto drive = [&](bool deferred) {
      auto a = *SparseAttention::FromDense(arena.get(), shape, 16, dense,
                                           *sparse::ParsePolicy(name, 0.05));
      Run run;
      std::vector<float> out(q_row), lse(8);
      for (int64_t st = 0; st < steps; ++st) {
        for (int layer = 0; layer < 3; ++layer) {
          EXPECT_TRUE(a->AppendToken(layer, tokens + st, k[st][layer].data(),
                                     v[st][layer].data())
                          .ok());
          const float* ql = q[st][layer].data();
          for (int u = 0; u < 2; ++u) a->SelectUnit(u, ql, {}, scales[st]);
          if (a->observe_pending()) {  // after the selections: they may run in either order
            for (int u = 1; u >= 0; --u) a->ObservePending(u);
            a->EndObserve();
          }
          for (int h = 0; h < 2; ++h) {
            const auto& sp = a->head_spans(h);
            run.spans.push_back(sp);
            kernels::cpu::PagedAttention(a->kv().view(), sp.data(), sp.size(),
                                         {ql + h * 4 * 64, 4, shape.scale},
                                         {out.data() + h * 4 * 64, lse.data() + h * 4});
          }
          for (int u = 0; u < 2; ++u) {
            if (deferred) {
              a->CompleteUnit(u, ql, out.data(), lse.data());
            } else {
              a->FinishUnit(u, ql, out.data(), lse.data());
            }
          }
          if (deferred) a->DeferObserve(ql);
          run.out.insert(run.out.end(), out.begin(), out.end());
        }
      }
      run.stats = a->stats();
      return run;
    };
    const Run now = drive(false), later = drive(true);
    ASSERT_EQ(now.spans.size(), later.spans.size());
    for (size_t i = 0; i < now.spans.size(); ++i) {
      ASSERT_EQ(now.spans[i].size(), later.spans[i].size()) << name << " plan " << i;
      for (size_t j = 0; j < now.spans[i].size(); ++j) {
        const kernels::PageSpan &x = now.spans[i][j], &y = later.spans[i][j];
        ASSERT_TRUE(x.page == y.page && x.first_row == y.first_row && x.rows == y.rows)
            << name << " plan " << i << " span " << j;
      }
    }
    EXPECT_EQ(now.out, later.out) << name;
    EXPECT_EQ(now.stats.k_rows_scored, later.stats.k_rows_scored) << name;
    EXPECT_EQ(now.stats.candidate_rows, later.stats.candidate_rows) << name;
    EXPECT_EQ(now.stats.candidate_steps_prepared, 0) << name;
    // Every table step but the first of each (layer, head) and those after a budget change.
    EXPECT_GE(now.stats.candidate_steps, 6 * 7) << name;
    EXPECT_GE(later.stats.candidate_steps_prepared, now.stats.candidate_steps - 6 * 3) << name;
    EXPECT_LT(later.stats.candidate_steps_prepared, now.stats.candidate_steps) << name;
  }
  EXPECT_EQ(arena->counters().reserved, 0);
}

TEST(SparseAttentionTest, ArenaTooSmallIsResourceExhaustedAndLeaksNothing) {
  auto s = MakeSetup(300, 4);
  auto arena = *KvArena::Create(KvShape{1, 2, 64, 16}.page_bytes(), 10);
  auto a = SparseAttention::FromDense(arena.get(), kShape, 16, s->dense,
                                      *sparse::ParsePolicy("full", 1.0));
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(arena->counters().free, 10);
}

TEST(PolicyTest, NamesAndBudgetsAreValidated) {
  EXPECT_EQ(sparse::ParsePolicy("bogus", 0.05).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NE(sparse::ParsePolicy("bogus", 0.05).status().message().find("exact_topk"),
            std::string::npos);
  EXPECT_FALSE(sparse::ParsePolicy("quest", 0.0).ok());
  EXPECT_FALSE(sparse::ParsePolicy("quest", 1.5).ok());
  EXPECT_FALSE(sparse::ParsePolicy("fixed_20_0.05", 0.05).ok());
  auto fixed = sparse::ParsePolicy("fixed_64_0.02", 0.5);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->block_tokens, 64);
  EXPECT_DOUBLE_EQ(fixed->budget, 0.02);
}

}  // namespace
}  // namespace fluxion::decode
