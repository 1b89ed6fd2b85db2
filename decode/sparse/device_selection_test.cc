#include "decode/sparse/device_selection.h"

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/fluxion_policy.h"
#include "gtest/gtest.h"
#include "kernels/cpu/compact_topk.h"
#include "model/sparse_state.h"

namespace fluxion::decode::sparse {
namespace {

constexpr int64_t kTokens = 1500, kDim = 32;

// One layer of two KV heads (one query head each) with random keys and a few keys aligned with
// the query on each head, so the picks are not ties.
struct Fixture {
  Fixture()
      : arena(*KvArena::Create(KvShape{1, 2, kDim, 16}.page_bytes(), 2 * (kTokens / 16 + 2))),
        kv(*PagedKv::Create(arena.get(), KvShape{1, 2, kDim, 16})),
        q(2 * kDim) {
    std::mt19937 rng(17);
    std::normal_distribution<float> normal(0, 1);
    for (float& x : q) x = normal(rng);
    k.resize(kTokens * 2 * kDim);
    v.resize(kTokens * 2 * kDim);
    for (float& x : k) x = 0.3f * normal(rng);
    for (float& x : v) x = normal(rng);
    for (int64_t t = 100; t < kTokens; t += 37) {
      for (int h = 0; h < 2; ++h) {
        for (int64_t j = 0; j < kDim; ++j) k[(t * 2 + h) * kDim + j] += q[h * kDim + j];
      }
    }
    EXPECT_TRUE(kv->Append(0, kTokens, k.data(), v.data(), 2 * kDim).ok());
  }
  SelectionInput Input(int h) const {
    return {kv.get(), 0, h, q.data() + h * kDim, 1, 1.0f / std::sqrt(float{kDim}), kTokens};
  }
  // The picks the device would make for head h over [begin, end): the reference, written from
  // the compact-key contract directly.
  std::vector<int32_t> ReferencePicks(int h, int64_t begin, int64_t end, int64_t n) const {
    kernels::cpu::CompactQuery cq;
    kernels::cpu::CompactQueryGroup(q.data() + h * kDim, 1, kDim, &cq);
    std::vector<float> scores;
    std::vector<int8_t> row(kDim);
    for (int64_t t = begin; t < end; ++t) {
      const float s = kernels::cpu::CompactKeyRowFromFloat(&k[(t * 2 + h) * kDim], kDim,
                                                           row.data());
      scores.push_back(kernels::cpu::CompactGroupScore(cq, row.data(), s));
    }
    std::vector<int32_t> picks;
    kernels::cpu::CompactTopKPositions(scores.data(), end - begin, n, begin, &picks);
    return picks;
  }
  std::unique_ptr<KvArena> arena;
  std::unique_ptr<PagedKv> kv;
  std::vector<float> q, k, v;
};

// Rows a span list covers, in order.
std::vector<int32_t> Rows(const PagedKv& kv, int h, const std::vector<kernels::PageSpan>& spans) {
  const auto& pages = kv.pages(0, h);
  std::vector<int32_t> rows;
  for (const kernels::PageSpan& s : spans) {
    const int64_t logical = std::find(pages.begin(), pages.end(), s.page) - pages.begin();
    for (int32_t r = 0; r < s.rows; ++r) rows.push_back(logical * 16 + s.first_row + r);
  }
  return rows;
}

TEST(DeviceSelectionTest, ExactTopKUnderTheDeviceSelectorAttendsTheCompactTopK) {
  Fixture f;
  PolicyConfig config = *ParsePolicy("exact_topk", 0.1);
  config.selector = Selector::kDevice;
  EXPECT_EQ(PolicyLabel(config), "exact_topk@0.1+device");
  std::unique_ptr<SparsePolicy> policy = MakePolicy(config);
  const SelectionInput in = f.Input(1);
  const std::optional<DeviceAsk> ask = policy->DevicePick(in);
  ASSERT_TRUE(ask.has_value());
  EXPECT_EQ(ask->candidates, nullptr) << "the whole middle competes";
  const kernels::CompactPick* pick = &ask->pick;
  const int64_t budget = static_cast<int64_t>(std::ceil(0.1 * kTokens));
  EXPECT_EQ(pick->begin, 4);
  EXPECT_EQ(pick->end, kTokens - 64);
  EXPECT_EQ(pick->k, budget - 4 - 64);
  std::vector<kernels::PageSpan> spans;
  SelectionStats stats;
  policy->Select(in, &spans, &stats);
  std::vector<int32_t> want = {0, 1, 2, 3};
  for (int32_t t : f.ReferencePicks(1, pick->begin, pick->end, pick->k)) want.push_back(t);
  for (int32_t t = kTokens - 64; t < kTokens; ++t) want.push_back(t);
  EXPECT_EQ(Rows(*f.kv, 1, spans), want);
  EXPECT_EQ(stats.k_rows_scored, pick->end - pick->begin) << "scored here, on the CPU";
  EXPECT_EQ(stats.rows_attended, budget);
}

TEST(DeviceSelectionTest, PicksHandedOverAreAttendedAsGivenAndScoreNothing) {
  Fixture f;
  PolicyConfig config = *ParsePolicy("exact_topk", 0.1);
  config.selector = Selector::kDevice;
  std::unique_ptr<SparsePolicy> policy = MakePolicy(config);
  SelectionInput in = f.Input(0);
  const kernels::CompactPick pick = policy->DevicePick(in)->pick;
  // Any ascending positions the device chose: every other middle row from 10 on.
  std::vector<int32_t> given;
  for (int32_t t = 10; static_cast<int64_t>(given.size()) < pick.k; t += 2) given.push_back(t);
  in.device_picks = given.data();
  in.device_pick_count = pick.k;
  std::vector<kernels::PageSpan> spans;
  SelectionStats stats;
  policy->Select(in, &spans, &stats);
  const std::vector<int32_t> rows = Rows(*f.kv, 0, spans);
  EXPECT_EQ(std::vector<int32_t>(rows.begin() + 4, rows.begin() + 4 + pick.k), given);
  EXPECT_EQ(stats.k_rows_scored, 0);
  EXPECT_EQ(stats.selections_ranked_elsewhere, 1);
}

TEST(DeviceSelectionTest, FluxionPicksEachHeadsAllocatedBudgetFromCompactKeys) {
  Fixture f;
  PolicyConfig config = *ParsePolicy("fluxion_rules", 0.1);
  config.selector = Selector::kDevice;
  FluxionPolicy policy(config, nullptr);
  for (int h = 0; h < 2; ++h) ASSERT_TRUE(policy.Prepare(*f.kv, 0, h, nullptr).ok());
  for (int h = 0; h < 2; ++h) {
    SCOPED_TRACE(h);
    const SelectionInput in = f.Input(h);
    const kernels::CompactPick pick = policy.DevicePick(in)->pick;
    // Without a prefill's features every head keeps the uniform weight.
    EXPECT_EQ(pick.k, static_cast<int64_t>(std::ceil(0.1 * kTokens)) - 68);
    std::vector<kernels::PageSpan> spans;
    SelectionStats stats;
    policy.Select(in, &spans, &stats);
    const std::vector<int32_t> rows = Rows(*f.kv, h, spans);
    EXPECT_EQ(std::vector<int32_t>(rows.begin() + 4, rows.begin() + 4 + pick.k),
              f.ReferencePicks(h, pick.begin, pick.end, pick.k));
    EXPECT_EQ(stats.metadata_bytes, 0) << "no page bounds scanned";
    policy.Observe(in, spans);  // keeps no tables under the device selector
  }
}

// LFPS's head with captured tables (no bypass: the prefill measured its middle share at 1): every
// position of the vertical table holds some weight (a few much more), the slash table a few
// distances.
model::HeadSparseState TablesState() {
  model::HeadSparseState state;
  state.vertical.assign(kTokens, 0.0f);
  state.slash.assign(kTokens, 0.0f);
  for (int64_t t = 0; t < kTokens; ++t) state.vertical[t] = 0.001f * ((t * 7919) % 100 + 1);
  for (int64_t t : {137, 400, 401, 702, 1100}) state.vertical[t] = 0.5f;
  for (int64_t dist : {200, 650}) state.slash[dist] = 0.3f;
  return state;
}

TEST(DeviceSelectionTest, LfpsPicksTheCompactTopKOfItsTableCandidates) {
  Fixture f;
  PolicyConfig config = *ParsePolicy("lfps", 0.1);
  config.selector = Selector::kDevice;
  EXPECT_TRUE(DeviceSelects(config));
  std::unique_ptr<SparsePolicy> policy = MakePolicy(config);
  const model::HeadSparseState state = TablesState();
  ASSERT_TRUE(policy->Prepare(*f.kv, 0, 0, &state).ok());
  const SelectionInput in = f.Input(0);
  const std::optional<DeviceAsk> ask = policy->DevicePick(in);
  ASSERT_TRUE(ask.has_value());
  ASSERT_NE(ask->candidates, nullptr) << "the tables' candidates, not the whole middle";
  const kernels::CompactPick& pick = ask->pick;
  std::vector<int32_t> candidates;
  for (int64_t j = 0; j < pick.end - pick.begin; ++j) {
    if ((*ask->candidates)[j / 64] >> (j % 64) & 1) candidates.push_back(pick.begin + j);
  }
  // At least 2k entries per table (LFPS's lower clamp) over a middle of ~1,400 rows: many
  // candidates, not all rows.
  EXPECT_GT(candidates.size(), static_cast<size_t>(pick.k));
  EXPECT_LT(static_cast<int64_t>(candidates.size()), pick.end - pick.begin);
  EXPECT_EQ(pick.k, static_cast<int64_t>(std::ceil(0.1 * kTokens)) - 68);

  // The reference: the compact top-k over the candidates alone.
  kernels::cpu::CompactQuery cq;
  kernels::cpu::CompactQueryGroup(f.q.data(), 1, kDim, &cq);
  std::vector<float> scores;
  std::vector<int8_t> row(kDim);
  for (int32_t t : candidates) {
    const float scale =
        kernels::cpu::CompactKeyRowFromFloat(&f.k[(t * 2) * kDim], kDim, row.data());
    scores.push_back(kernels::cpu::CompactGroupScore(cq, row.data(), scale));
  }
  std::vector<int32_t> best;
  kernels::cpu::CompactTopKPositions(scores.data(), static_cast<int64_t>(scores.size()), pick.k,
                                     0, &best);
  std::vector<int32_t> want_middle;
  for (int32_t i : best) want_middle.push_back(candidates[i]);

  std::vector<kernels::PageSpan> spans;
  SelectionStats stats;
  policy->Select(in, &spans, &stats);
  const std::vector<int32_t> rows = Rows(*f.kv, 0, spans);
  ASSERT_GE(rows.size(), static_cast<size_t>(4 + pick.k));
  EXPECT_EQ(std::vector<int32_t>(rows.begin() + 4, rows.begin() + 4 + pick.k), want_middle);
  EXPECT_EQ(stats.candidate_steps, 1);
  EXPECT_EQ(stats.candidate_rows, static_cast<int64_t>(candidates.size()));
  policy->Observe(in, spans);  // the tables learn from what the step attended, as on the host
}

TEST(DeviceSelectionTest, LfpsHandedTheDevicesPicksAttendsThem) {
  Fixture f;
  PolicyConfig config = *ParsePolicy("lfps", 0.1);
  config.selector = Selector::kDevice;
  std::unique_ptr<SparsePolicy> policy = MakePolicy(config);
  const model::HeadSparseState state = TablesState();
  ASSERT_TRUE(policy->Prepare(*f.kv, 0, 1, &state).ok());
  SelectionInput in = f.Input(1);
  const DeviceAsk ask = *policy->DevicePick(in);
  ASSERT_NE(ask.candidates, nullptr);
  // The device's picks: any k ascending candidates (here the first k).
  std::vector<int32_t> given;
  for (int64_t j = 0; static_cast<int64_t>(given.size()) < ask.pick.k; ++j) {
    if ((*ask.candidates)[j / 64] >> (j % 64) & 1) given.push_back(ask.pick.begin + j);
  }
  in.device_picks = given.data();
  in.device_pick_count = ask.pick.k;
  std::vector<kernels::PageSpan> spans;
  SelectionStats stats;
  policy->Select(in, &spans, &stats);
  const std::vector<int32_t> rows = Rows(*f.kv, 1, spans);
  EXPECT_EQ(std::vector<int32_t>(rows.begin() + 4, rows.begin() + 4 + ask.pick.k), given);
  EXPECT_EQ(stats.selections_ranked_elsewhere, 1);
  EXPECT_EQ(stats.k_rows_scored, 0) << "nothing rescored on the host";
}

TEST(DeviceSelectionTest, LfpsWithoutTablesRefreshesOverTheWholeMiddle) {
  Fixture f;
  PolicyConfig config = *ParsePolicy("lfps", 0.1);
  config.selector = Selector::kDevice;
  std::unique_ptr<SparsePolicy> policy = MakePolicy(config);
  ASSERT_TRUE(policy->Prepare(*f.kv, 0, 0, nullptr).ok());  // no capture: a refresh is due
  const SelectionInput in = f.Input(0);
  const DeviceAsk ask = *policy->DevicePick(in);
  EXPECT_EQ(ask.candidates, nullptr);
  std::vector<kernels::PageSpan> spans;
  SelectionStats stats;
  policy->Select(in, &spans, &stats);
  const std::vector<int32_t> rows = Rows(*f.kv, 0, spans);
  EXPECT_EQ(std::vector<int32_t>(rows.begin() + 4, rows.begin() + 4 + ask.pick.k),
            f.ReferencePicks(0, ask.pick.begin, ask.pick.end, ask.pick.k));
}

TEST(DeviceSelectionTest, EveryPolicyButTheDeviceRankedBaselinesSelectsOnTheDevice) {
  const std::vector<PolicyConfig> configs = {*ParsePolicy("quest", 0.05),
                                             *ParsePolicy("fluxion", 0.05),
                                             *ParsePolicy("lfps", 0.05)};
  const std::vector<PolicyConfig> out =
      ExpandSelectors(configs, {Selector::kHost, Selector::kDevice});
  std::vector<std::string> labels;
  for (const PolicyConfig& c : out) labels.push_back(PolicyLabel(c));
  EXPECT_EQ(labels, (std::vector<std::string>{"quest@0.05", "fluxion@0.05", "fluxion@0.05+device",
                                              "lfps@0.05", "lfps@0.05+device"}));
  EXPECT_FALSE(ReadsPageScores(out[2])) << "compact keys replace Fluxion's page scores";
  EXPECT_TRUE(ReadsPageScores(out[1]));
  EXPECT_FALSE(MakePolicy(out[0])->DevicePick({}).has_value()) << "quest ranks page bounds";
  EXPECT_FALSE(MakePolicy(out[3])->DevicePick({}).has_value()) << "the host selector";
  EXPECT_EQ(*ParseSelector("device"), Selector::kDevice);
  EXPECT_FALSE(ParseSelector("gpu").ok());
}

}  // namespace
}  // namespace fluxion::decode::sparse
