#include "decode/sparse/lfps_policy.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
#include "gtest/gtest.h"

namespace fluxion::decode::sparse {
namespace {

constexpr int64_t kPrompt = 2048, kSteps = 12, kDim = 64, kTargetBase = 1000;

// One KV head with one query head, built so that every logit is known (scale 1/8, |u| = 1):
// sinks at 12, the newest 64 keys (the window) at 10, background near 0, and at step s one
// target key (position kTargetBase + s, along its own direction v_s) at 12 * strength[s]. A
// copy head: the attended position moves every step and its share of the mass swings with it.
struct CopyHead {
  std::vector<float> k, v;
  std::vector<std::vector<float>> q;  // per step
};

CopyHead MakeCopyHead(const std::vector<double>& strength, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  auto unit = [&](const std::vector<float>* orthogonal_to) {
    std::vector<float> x(kDim);
    for (float& e : x) e = normal(rng);
    if (orthogonal_to != nullptr) {
      double dot = 0;
      for (int64_t j = 0; j < kDim; ++j) dot += x[j] * (*orthogonal_to)[j];
      for (int64_t j = 0; j < kDim; ++j) x[j] -= static_cast<float>(dot) * (*orthogonal_to)[j];
    }
    double norm = 0;
    for (float e : x) norm += e * e;
    for (float& e : x) e /= static_cast<float>(std::sqrt(norm));
    return x;
  };
  const int64_t total = kPrompt + kSteps;
  CopyHead h{std::vector<float>(total * kDim), std::vector<float>(total * kDim), {}};
  for (float& x : h.k) x = 0.3f * normal(rng);
  for (float& x : h.v) x = normal(rng);
  const std::vector<float> u = unit(nullptr);
  auto set = [&](int64_t t, const std::vector<float>& dir, float length) {
    for (int64_t j = 0; j < kDim; ++j) h.k[t * kDim + j] = length * dir[j];
  };
  for (int64_t t = 0; t < 4; ++t) set(t, u, 12.0f);
  for (int64_t t = kPrompt - 64; t < total; ++t) set(t, u, 10.0f);
  for (int64_t s = 0; s < kSteps; ++s) {
    const std::vector<float> dir = unit(&u);
    set(kTargetBase + s, dir, 12.0f);
    std::vector<float> q(kDim);
    const float c = static_cast<float>(strength[s]);
    for (int64_t j = 0; j < kDim; ++j) q[j] = 8.0f * (u[j] + c * dir[j]);
    h.q.push_back(q);
  }
  return h;
}

struct StepResult {
  bool bypassed;
  bool attended_target;
  int64_t k_rows_scored;
  std::vector<kernels::PageSpan> spans;
};

std::vector<StepResult> RunSteps(const CopyHead& h, const std::string& policy_name = "lfps",
                                 double budget = 0.05) {
  const KvShape shape{1, 1, kDim, 16};
  auto arena = *KvArena::Create(shape.page_bytes(), (kPrompt + kSteps) / 16 + 2);
  auto kv = *PagedKv::Create(arena.get(), shape);
  EXPECT_TRUE(kv->Append(0, kPrompt + kSteps, h.k.data(), h.v.data(), kDim).ok());
  auto policy = MakePolicy(*ParsePolicy(policy_name, budget));
  std::vector<StepResult> out;
  for (int64_t s = 0; s < kSteps; ++s) {
    const int64_t context = kPrompt + s + 1;
    const SelectionInput in{kv.get(), 0, 0, h.q[s].data(), 1, 0.125f, context};
    std::vector<kernels::PageSpan> spans;
    SelectionStats stats;
    policy->Select(in, &spans, &stats);
    const int64_t target = kTargetBase + s;
    const int32_t page = kv->pages(0, 0)[target / 16], row = static_cast<int32_t>(target % 16);
    bool hit = false;
    for (const kernels::PageSpan& sp : spans) {
      hit |= sp.page == page && row >= sp.first_row && row < sp.first_row + sp.rows;
    }
    out.push_back({stats.bypassed > 0, hit, stats.k_rows_scored, spans});
    policy->Observe(in, spans);
  }
  return out;
}

// The target holds ~30% of the mass at most steps and ~1-2% at a few. One low step is no evidence
// that the head turned streaming: LFPS must keep attending the middle (and find each step's
// target), where it used to bypass for the rest of the refresh period after the first low step.
TEST(LfpsPolicyTest, CopyHeadIsNotBypassedAfterOneLowStep) {
  std::vector<double> strength(kSteps, 1.14);
  strength[2] = strength[7] = 0.8;
  const std::vector<StepResult> steps = RunSteps(MakeCopyHead(strength, 11));
  for (int64_t s = 0; s < kSteps; ++s) {
    EXPECT_FALSE(steps[s].bypassed) << "step " << s;
    if (strength[s] > 1.0) {
      EXPECT_TRUE(steps[s].attended_target) << "step " << s;
    }
  }
}

// The other side of the same rule: a head whose middle never holds mass (no target at all) is
// still bypassed once its recent steps all measured a tiny middle share.
TEST(LfpsPolicyTest, HeadWithAnEmptyMiddleIsBypassed) {
  const std::vector<StepResult> steps =
      RunSteps(MakeCopyHead(std::vector<double>(kSteps, 0.0), 12));
  int bypassed = 0;
  for (const StepResult& s : steps) bypassed += s.bypassed;
  EXPECT_GE(bypassed, kSteps / 2);
}

}  // namespace
}  // namespace fluxion::decode::sparse
