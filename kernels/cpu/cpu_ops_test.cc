// Conformance: every CPU kernel against its reference twin on random inputs over a grid of shapes.
// Tolerance: both sides are fp32 (the reference accumulates in double), so the only differences are
// summation order and fp32 rounding: relative L2 error <= 1e-5 (a wrong index or a missed mask
// gives errors of order 1).
#include <cmath>
#include <random>
#include <vector>

#include "common/random_testing.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/reference/reference_ops.h"
#include "kernels/reference/compare.h"

namespace fluxion::kernels {
namespace {

constexpr double kRelTol = 1e-5;

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  return kernels::reference::RelativeL2Error(got, want);
}

TEST(CpuOpsTest, MatMulMatchesReferenceForVectorsAndMatrices) {
  for (int64_t m : {1, 3, 70}) {
    for (bool accumulate : {false, true}) {
      const int64_t n = 48, k = 80;
      auto x = RandomNormal(m * k, 1), w = RandomNormal(n * k, 2), b = RandomNormal(n, 3), y0 = RandomNormal(m * n, 4);
      std::vector<float> got = y0, want = y0;
      cpu::MatMul(x.data(), w.data(), b.data(), got.data(), m, n, k, accumulate);
      reference::MatMul(x.data(), w.data(), b.data(), want.data(), m, n, k, accumulate);
      EXPECT_LT(RelErr(got, want), kRelTol) << "m=" << m << " accumulate=" << accumulate;
    }
  }
}

TEST(CpuOpsTest, RmsNormMatchesReference) {
  const int64_t m = 9, d = 100;
  auto x = RandomNormal(m * d, 5, 3.0f), w = RandomNormal(d, 6);
  std::vector<float> got(m * d), want(m * d);
  cpu::RmsNorm(x.data(), w.data(), 1e-5f, got.data(), m, d);
  reference::RmsNorm(x.data(), w.data(), 1e-5f, want.data(), m, d);
  EXPECT_LT(RelErr(got, want), kRelTol);
}

TEST(CpuOpsTest, RopeMatchesReferenceAtLargePositions) {
  const int64_t n = 5, heads = 3, d = 32;
  std::vector<int64_t> pos = {0, 1, 17, 1000, 4000};
  std::vector<float> inv_freq(d / 2);
  for (int64_t i = 0; i < d / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / d);
  auto got = RandomNormal(n * heads * d, 7);
  auto want = got;
  cpu::ApplyRope(got.data(), pos.data(), inv_freq.data(), n, heads, d);
  reference::ApplyRope(want.data(), pos.data(), inv_freq.data(), n, heads, d);
  // The CPU kernel takes the angle in fp32 (as transformers does); at position 4000 that alone
  // moves the angle by up to ~2e-4 rad, so this bound is looser than kRelTol.
  EXPECT_LT(RelErr(got, want), 2e-4);
}

TEST(CpuOpsTest, SiluMulMatchesReference) {
  auto g = RandomNormal(1000, 8, 4.0f), u = RandomNormal(1000, 9);
  std::vector<float> got(1000), want(1000);
  cpu::SiluMul(g.data(), u.data(), got.data(), 1000);
  reference::SiluMul(g.data(), u.data(), want.data(), 1000);
  EXPECT_LT(RelErr(got, want), kRelTol);
}

TEST(CpuOpsTest, AccumulateMomentsMatchesDirectSums) {
  const int64_t n = 300, d = 24;
  auto x = RandomNormal(n * d, 13);
  std::vector<double> sums(d, 1.0), outer(d * d, 2.0);  // accumulates onto what is there
  cpu::AccumulateMoments(x.data(), n, d, sums.data(), outer.data());
  for (int64_t i = 0; i < d; ++i) {
    double s = 1.0;
    for (int64_t r = 0; r < n; ++r) s += x[r * d + i];
    EXPECT_NEAR(sums[i], s, 1e-3);
    for (int64_t j = 0; j < d; ++j) {
      double o = 2.0;
      for (int64_t r = 0; r < n; ++r) o += double(x[r * d + i]) * x[r * d + j];
      EXPECT_NEAR(outer[i * d + j], o, 1e-3 * std::max(1.0, std::abs(o)));
    }
  }
}

struct AttentionCase {
  int64_t n, pos0, heads, kv_heads, head_dim;
};

class CausalAttentionTest : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(CausalAttentionTest, MatchesReferenceWithinTolerance) {
  const AttentionCase c = GetParam();
  AttentionParams p{c.n, c.pos0, c.heads, c.kv_heads, c.head_dim,
                    1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  const int64_t keys = c.pos0 + c.n;
  auto q = RandomNormal(c.n * c.heads * c.head_dim, 10, 2.0f);
  auto k = RandomNormal(keys * c.kv_heads * c.head_dim, 11, 2.0f);
  auto v = RandomNormal(keys * c.kv_heads * c.head_dim, 12);
  std::vector<float> got(q.size(), NAN), want(q.size());
  cpu::CausalAttention(q.data(), k.data(), v.data(), got.data(), p);
  reference::CausalAttention(q.data(), k.data(), v.data(), want.data(), p);
  EXPECT_LT(RelErr(got, want), kRelTol);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CausalAttentionTest,
    ::testing::Values(AttentionCase{1, 0, 4, 4, 16},      // first token, MHA
                      AttentionCase{1, 300, 8, 2, 64},    // decode step, GQA 4:1
                      AttentionCase{1, 129, 8, 1, 128},   // decode step, MQA, head_dim 128
                      AttentionCase{100, 0, 4, 2, 32},    // prefill spanning two query tiles
                      AttentionCase{65, 40, 6, 3, 24},    // chunked prefill continuing a sequence
                      AttentionCase{7, 5, 14, 2, 64},     // Qwen2.5-0.5B head layout
                      AttentionCase{1, 1500, 8, 4, 32},   // decode step over three key chunks
                      AttentionCase{130, 1000, 8, 4, 32}, // tiles whose mask cuts a key chunk
                      AttentionCase{600, 0, 2, 1, 32}));  // prefill longer than one key chunk

}  // namespace
}  // namespace fluxion::kernels
