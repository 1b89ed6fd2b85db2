#include "decode/sparse/error_guard.h"

#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "common/flag_set.h"
#include "decode/kv/kv_arena.h"
#include "decode/kv/paged_kv.h"
#include "decode/sparse/guard_flags.h"
#include "decode/sparse/policy.h"
#include "decode/step/sparse_attention.h"
#include "gtest/gtest.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "model/output_projection.h"

namespace fluxion::decode::sparse {
namespace {

GuardConfig On(double rate) {
  GuardConfig c;  // the tests' own step sizes, independent of the calibrated defaults
  c.enabled = true;
  c.sample_rate = rate;
  c.tolerance = 0.05;
  c.max_weight = 8;
  return c;
}

// e_h by hand: W_O = [[1, 0, 2, 0], [0, 1, 0, 3]] (hidden 2, two heads of width 2).
TEST(OutputProjectionTest, HeadErrorIsTheHeadSliceOfWoOverTheLayerOutput) {
  const std::vector<float> w = {1, 0, 2, 0, 0, 1, 0, 3};
  const model::OutputProjection proj(2, 4, {w.data()});
  const std::vector<float> o = {1, 1, 1, 1};
  EXPECT_DOUBLE_EQ(proj.Norm(0, o.data()), std::sqrt(3.0 * 3.0 + 4.0 * 4.0));
  const float exact[2] = {1, 1}, approx[2] = {1, 0};
  // Head 1 (columns 2-3): W_O^1 (exact - approx) = (0, 3); over ||W_O o|| = 5.
  EXPECT_DOUBLE_EQ(model::HeadOutputError(proj, 0, 2, exact, approx, 2, 5.0), 3.0 / 5.0);
  EXPECT_DOUBLE_EQ(model::HeadOutputError(proj, 0, 2, exact, approx, 2, 0.0), 0.0);
  const model::OutputProjection id = model::OutputProjection::Identity(1, 4);
  EXPECT_DOUBLE_EQ(id.SliceNorm(0, 1, exact, 2), std::sqrt(2.0));
}

TEST(ErrorGuardTest, ChecksRotateThroughEveryPairAtTheSampleRate) {
  ErrorGuard guard(On(1.0 / 24), 6, 4, [](int, int) { return 1.0; });
  std::set<std::pair<int, int>> seen;
  for (int step = 0; step < 24; ++step) {
    guard.BeginStep();
    int due = 0;
    for (int l = 0; l < 6; ++l) {
      for (int h = 0; h < 4; ++h) {
        if (guard.Due(l, h)) {
          ++due;
          seen.insert({l, h});
        }
      }
    }
    EXPECT_EQ(due, 1) << "step " << step;
  }
  EXPECT_EQ(seen.size(), 24u);  // each pair once in 24 steps
  // A rate of 1/48 checks every other step.
  ErrorGuard half(On(1.0 / 48), 6, 4, [](int, int) { return 1.0; });
  int due = 0;
  for (int step = 0; step < 48; ++step) {
    half.BeginStep();
    for (int l = 0; l < 6; ++l) {
      for (int h = 0; h < 4; ++h) due += half.Due(l, h);
    }
  }
  EXPECT_EQ(due, 24);
}

TEST(ErrorGuardTest, EscalationTakesFromHeadsFarBelowToleranceFirst) {
  ErrorGuard guard(On(1.0), 1, 4, [](int, int) { return 1.0; });
  guard.BeginStep();
  guard.Report(0, 3, 0.001, 100);  // far below: relaxes (never escalated: hold 1), a donor now
  const double w3 = guard.Weight(0, 3);
  EXPECT_LT(w3, 1.0);
  guard.Report(0, 1, 0.03, 100);  // within tolerance: neither
  guard.Report(0, 0, 0.5, 100);   // above: escalates
  EXPECT_GT(guard.Weight(0, 0), 1.9);
  EXPECT_EQ(guard.stats().escalations, 1);
  EXPECT_EQ(guard.stats().relaxations, 1);
  // Head 3 paid first: what it held went to head 0 before heads 1 and 2 gave anything.
  EXPECT_NEAR(guard.Weight(0, 3), 0.0, 1e-9);
  EXPECT_LT(guard.Weight(0, 1), 1.0 + 1e-9);
  EXPECT_NEAR(guard.TotalWeight(), 4.0, 1e-9);
  EXPECT_EQ(guard.stats().checks, 3);
  EXPECT_EQ(guard.stats().check_rows, 300);
  EXPECT_EQ(guard.stats().errors.size(), 3u);
}

// A head whose error does not fall with more budget (a diffuse head) gets its escalation undone
// and may not escalate again for a while: it cannot collect the request's budget.
TEST(ErrorGuardTest, AnEscalationThatBuysNoSmallerErrorIsReverted) {
  ErrorGuard guard(On(1.0), 1, 4, [](int, int) { return 1.0; });
  guard.BeginStep();
  guard.Report(0, 0, 0.5, 1);  // escalates to 2
  EXPECT_NEAR(guard.Weight(0, 0), 2.0, 1e-9);
  guard.Report(0, 0, 0.45, 1);  // barely lower: futile, back to 1
  EXPECT_NEAR(guard.Weight(0, 0), 1.0, 1e-9);
  EXPECT_EQ(guard.stats().reverts, 1);
  for (int i = 0; i < 8; ++i) guard.Report(0, 0, 0.5, 1);  // cooling down: no escalation
  EXPECT_NEAR(guard.Weight(0, 0), 1.0, 1e-9);
  guard.Report(0, 0, 0.5, 1);  // may escalate again
  EXPECT_GT(guard.Weight(0, 0), 1.5);
  EXPECT_EQ(guard.stats().escalations, 2);
  // An escalation that worked stays: the error fell well below the one that caused it.
  guard.Report(0, 1, 0.5, 1);
  const double w1 = guard.Weight(0, 1);
  guard.Report(0, 1, 0.2, 1);
  EXPECT_NEAR(guard.Weight(0, 1), 2 * w1, 1e-9);  // escalated again, not reverted
  EXPECT_NEAR(guard.TotalWeight(), 4.0, 1e-9);
}

// Whatever the errors, the weights sum to what the policy started with (the request's total
// middle read), none is negative and none exceeds the cap.
TEST(ErrorGuardTest, BudgetIsConservedUnderAnySequenceOfChecks) {
  GuardConfig c = On(0.25);
  c.max_weight = 4;
  const std::vector<double> base = {0.0, 0.5, 1.0, 1.5, 2.0, 1.0, 0.0, 2.0};  // Fluxion-like
  ErrorGuard guard(c, 2, 4, [&](int l, int h) { return base[l * 4 + h]; });
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> error(0.0, 0.2);
  for (int step = 0; step < 2000; ++step) {
    guard.BeginStep();
    // This step applies the weights as the last one left them.
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 4; ++h) {
        ASSERT_NEAR(guard.Shift(l, h), guard.Weight(l, h) - base[l * 4 + h], 1e-12);
      }
    }
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 4; ++h) {
        // Layer 0's heads need nothing (they give back), layer 1's any error at all.
        const double e = error(rng);
        if (guard.Due(l, h)) guard.Report(l, h, l == 0 ? e / 100 : e, 1);
      }
    }
    ASSERT_NEAR(guard.TotalWeight(), 8.0, 1e-6) << "step " << step;
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 4; ++h) {
        ASSERT_GE(guard.Weight(l, h), -1e-9);
        ASSERT_LE(guard.Weight(l, h), c.max_weight + 1e-9);
      }
    }
  }
  EXPECT_GT(guard.stats().escalations, 0);
  EXPECT_GT(guard.stats().relaxations, 0);
}

TEST(ErrorGuardTest, ValidationNamesTheFlag) {
  EXPECT_TRUE(ValidateGuard(GuardConfig{}).ok());
  GuardConfig c;
  c.sample_rate = 0;
  EXPECT_NE(ValidateGuard(c).message().find("--guard-rate"), std::string::npos);
  c = GuardConfig{};
  c.sample_rate = 1.5;
  EXPECT_FALSE(ValidateGuard(c).ok());
  c = GuardConfig{};
  c.tolerance = -1;
  EXPECT_NE(ValidateGuard(c).message().find("--guard-tolerance"), std::string::npos);
  c = GuardConfig{};
  c.shrink = 1;
  EXPECT_NE(ValidateGuard(c).message().find("--guard-shrink"), std::string::npos);
  c = GuardConfig{};
  c.grow = 1;
  EXPECT_NE(ValidateGuard(c).message().find("--guard-grow"), std::string::npos);
}

absl::StatusOr<std::vector<bool>> ParseModes(const std::vector<std::string>& args,
                                             bool allow_both, GuardConfig* config) {
  FlagSet flags("test", "");
  GuardFlags guard(flags, allow_both);
  absl::Status s = flags.Parse(args);
  if (!s.ok()) return s;
  absl::StatusOr<GuardConfig> c = guard.Config();
  if (!c.ok()) return c.status();
  *config = *c;
  return guard.Modes();
}

TEST(GuardFlagsTest, ParsesModesAndRejectsBadValues) {
  GuardConfig c;
  EXPECT_EQ(*ParseModes({}, false, &c), std::vector<bool>{false});
  EXPECT_EQ(*ParseModes({"--guard", "on", "--guard-rate", "0.25"}, false, &c),
            std::vector<bool>{true});
  EXPECT_DOUBLE_EQ(c.sample_rate, 0.25);
  EXPECT_EQ(*ParseModes({"--guard", "both"}, true, &c), (std::vector<bool>{false, true}));
  auto both = ParseModes({"--guard", "both"}, false, &c);
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("--guard must be off or on"), std::string::npos);
  auto bad = ParseModes({"--guard", "yes"}, true, &c);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  auto rate = ParseModes({"--guard", "on", "--guard-rate", "0"}, false, &c);
  ASSERT_FALSE(rate.ok());
  EXPECT_NE(rate.status().message().find("--guard-rate"), std::string::npos);
}

TEST(GuardFlagsTest, OnlyLfpsAndFluxionAreGuardedAndLabelled) {
  auto proj = std::make_shared<const model::OutputProjection>(
      model::OutputProjection::Identity(1, 32));
  const std::vector<PolicyConfig> configs = {*ParsePolicy("full", 1), *ParsePolicy("quest", 0.05),
                                             *ParsePolicy("exact_topk", 0.05),
                                             *ParsePolicy("lfps", 0.05),
                                             *ParsePolicy("fluxion", 0.05)};
  const std::vector<PolicyConfig> out = ExpandGuard(configs, {false, true}, GuardConfig{}, proj);
  std::vector<std::string> labels;
  for (const PolicyConfig& c : out) labels.push_back(PolicyLabel(c));
  EXPECT_EQ(labels, (std::vector<std::string>{"full", "quest@0.05", "exact_topk@0.05",
                                              "lfps@0.05", "lfps@0.05+guard", "fluxion@0.05",
                                              "fluxion@0.05+guard"}));
  EXPECT_TRUE(GuardActive(out[4]));
  EXPECT_FALSE(GuardActive(out[3]));
  EXPECT_FALSE(GuardActive(WithGuard(configs[2], true, GuardConfig{}, proj)));
}

// --- The guard in a decode: a head whose needed budget changes mid-decode ---

// One layer, two KV heads of one query head each. Both start as sink heads (every query is
// drawn to the 4 sinks: the middle needs nothing). At `switch_step` head 0 turns into a retrieval
// head whose mass spreads evenly over 60 needle keys in the middle, more than the uniform middle
// budget (35-42 rows at budget 0.1 of ~1.1K tokens) holds, while head 1 stays a sink head. A
// fixed per-head budget leaves a third of head 0's needles out; the guard sees head 0's error,
// takes head 1's unneeded budget and gives it to head 0.
struct ShiftingHeads {
  static constexpr int64_t kPrompt = 1024, kSteps = 80, kSwitch = 20, kD = 32, kNeedles = 60;
  std::vector<float> s_dir = std::vector<float>(kD), n_dir = std::vector<float>(kD);
  std::vector<float> k, v;  // [prompt + steps][2][d]
  ShiftingHeads() {
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0, 1);
    s_dir[0] = 1;
    n_dir[1] = 1;
    const int64_t rows = kPrompt + kSteps;
    k.resize(rows * 2 * kD);
    v.resize(rows * 2 * kD);
    for (float& x : k) x = 0.3f * normal(rng);
    for (float& x : v) x = normal(rng);
    for (int64_t t = 0; t < rows; ++t) {
      for (int h = 0; h < 2; ++h) {
        float* key = &k[(t * 2 + h) * kD];
        if (t < 4) {
          for (int64_t i = 0; i < kD; ++i) key[i] = 8 * s_dir[i];
        } else if (h == 0 && t >= 320 && t < 320 + 2 * kNeedles && (t - 320) % 2 == 0) {
          for (int64_t i = 0; i < kD; ++i) key[i] = 8 * n_dir[i];
        }
      }
    }
  }
  std::vector<float> Query(int64_t step) const {
    std::vector<float> q(2 * kD);
    for (int64_t i = 0; i < kD; ++i) {
      q[i] = 8 * (step < kSwitch ? s_dir[i] : n_dir[i]);
      q[kD + i] = 8 * s_dir[i];
    }
    return q;
  }
};

struct DecodeResult {
  double late_error = 0;  // head 0's mean relative output error over steps >= switch + 10
  int64_t rows_attended = 0;
  GuardStats guard;
};

DecodeResult DecodeShiftingHeads(bool guard_on) {
  const ShiftingHeads data;
  constexpr int64_t d = ShiftingHeads::kD;
  const KvShape kv_shape{1, 2, d, 16};
  auto arena = *KvArena::Create(kv_shape.page_bytes(),
                                2 * ((ShiftingHeads::kPrompt + ShiftingHeads::kSteps) / 16 + 4));
  auto kv = *PagedKv::Create(arena.get(), kv_shape);
  EXPECT_TRUE(kv->Append(0, ShiftingHeads::kPrompt, data.k.data(), data.v.data(), 2 * d).ok());
  const model::AttentionShape shape{1, 2, 2, d, 1.0f / std::sqrt(static_cast<float>(d))};
  PolicyConfig config = *ParsePolicy("fluxion", 0.1);  // no predictor: the rules (weights 1)
  config = WithGuard(config, guard_on, On(0.5),
                     std::make_shared<const model::OutputProjection>(
                         model::OutputProjection::Identity(1, 2 * d)));
  auto attention = *SparseAttention::FromPages(std::move(kv), shape, config, nullptr);
  DecodeResult result;
  std::vector<float> out(2 * d), exact(d), lse(1);
  std::vector<kernels::PageSpan> spans;
  int64_t late = 0;
  for (int64_t s = 0; s < ShiftingHeads::kSteps; ++s) {
    const int64_t pos = ShiftingHeads::kPrompt + s;
    const std::vector<float> q = data.Query(s);
    EXPECT_TRUE(attention
                    ->Forward(0, pos, 1, q.data(), &data.k[pos * 2 * d], &data.v[pos * 2 * d],
                              out.data())
                    .ok());
    if (s < ShiftingHeads::kSwitch + 10) continue;
    spans.clear();
    AppendTokenRange(attention->kv(), 0, 0, 0, pos + 1, &spans);
    kernels::cpu::PagedAttention(attention->kv().view(), spans.data(), spans.size(),
                                 {q.data(), 1, shape.scale}, {exact.data(), lse.data()});
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < d; ++i) {
      diff += (exact[i] - out[i]) * (exact[i] - out[i]);
      norm += exact[i] * exact[i];
    }
    result.late_error += std::sqrt(diff / norm);
    ++late;
  }
  result.late_error /= late;
  result.rows_attended = attention->stats().rows_attended;
  result.guard = attention->guard_stats();
  return result;
}

TEST(ErrorGuardDecodeTest, GuardFollowsAHeadWhoseNeededBudgetGrowsMidDecode) {
  const DecodeResult fixed = DecodeShiftingHeads(false);
  const DecodeResult guarded = DecodeShiftingHeads(true);
  // Without the guard head 0 keeps its uniform share and misses a third of its needles.
  EXPECT_GT(fixed.late_error, 0.3);
  EXPECT_EQ(fixed.guard.checks, 0);
  // With it, head 0 got head 1's budget and found (nearly) every needle.
  EXPECT_LT(guarded.late_error, 0.1);
  EXPECT_LT(guarded.late_error, 0.25 * fixed.late_error);
  EXPECT_GT(guarded.guard.escalations, 0);
  // The request's read stayed within the configured budget (sinks + window + the uniform middle
  // budget per head and step), up to each head's rounding to whole rows (one per head and step).
  // Without the guard it read less: LFPS's bypass left the sink heads' middle budgets unspent.
  int64_t budget_rows = 0;
  for (int64_t s = 0; s < ShiftingHeads::kSteps; ++s) {
    const int64_t ctx = ShiftingHeads::kPrompt + s + 1;
    budget_rows += 2 * (static_cast<int64_t>(std::ceil(0.1 * ctx)) + 1);
  }
  EXPECT_LE(guarded.rows_attended, budget_rows);
  EXPECT_LE(fixed.rows_attended, budget_rows);
  EXPECT_GT(guarded.rows_attended, fixed.rows_attended);
  // The exact checks' reads are reported separately: one head of the two every step.
  EXPECT_EQ(guarded.guard.checks, ShiftingHeads::kSteps);
  EXPECT_GT(guarded.guard.check_rows, ShiftingHeads::kSteps * ShiftingHeads::kPrompt);
}

}  // namespace
}  // namespace fluxion::decode::sparse
