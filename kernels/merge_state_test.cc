// MergeStates (kernels/{reference,cpu}/merge_state.h): every implementation against the reference
// on random states, the empty-state (-inf) rules for each, and the property the seam rests on:
// attending two disjoint row sets and merging equals attending their union.
// Tolerance: fp32 against double: relative L2 <= 1e-6 on outputs, 1e-5 absolute on lse.
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/merge_state.h"
#include "kernels/reference/compare.h"
#include "kernels/reference/merge_state.h"
#include "kernels/reference/reference_ops.h"

namespace fluxion::kernels {
namespace {

using MergeFn = void (*)(float*, float*, const float*, const float*, int64_t, int64_t);

struct Impl {
  std::string name;
  MergeFn merge;
};

class MergeStatesTest : public testing::TestWithParam<Impl> {};

TEST_P(MergeStatesTest, MatchesReferenceOnRandomStates) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t d : {64, 128}) {
    const int64_t rows = 37;
    std::vector<float> a(rows * d), b(rows * d), la(rows), lb(rows);
    for (float& x : a) x = normal(rng);
    for (float& x : b) x = normal(rng);
    for (int64_t i = 0; i < rows; ++i) {
      la[i] = 4.0f * normal(rng);
      lb[i] = 4.0f * normal(rng);
    }
    la[3] = -INFINITY;  // a few empty states mixed in
    lb[5] = -INFINITY;
    la[7] = lb[7] = -INFINITY;
    std::fill_n(a.begin() + 3 * d, d, 0.0f);
    std::fill_n(a.begin() + 7 * d, d, 0.0f);
    std::vector<float> want = a, want_l = la;
    reference::MergeStates(want.data(), want_l.data(), b.data(), lb.data(), rows, d);
    GetParam().merge(a.data(), la.data(), b.data(), lb.data(), rows, d);
    EXPECT_LE(reference::RelativeL2Error(a, want), 1e-6);
    for (int64_t i = 0; i < rows; ++i) {
      if (want_l[i] == -INFINITY) {
        EXPECT_EQ(la[i], -INFINITY) << i;
      } else {
        EXPECT_NEAR(la[i], want_l[i], 1e-5) << i;
      }
    }
  }
}

TEST_P(MergeStatesTest, EmptyStatesAreTheIdentity) {
  const int64_t d = 16;
  const std::vector<float> x(d, 0.5f), zeros(d, 0.0f);
  // b empty: a unchanged.
  std::vector<float> a = x;
  float la = 1.25f, lb = -INFINITY;
  GetParam().merge(a.data(), &la, zeros.data(), &lb, 1, d);
  EXPECT_EQ(a, x);
  EXPECT_EQ(la, 1.25f);
  // a empty, b not: a := b exactly (no NaN from -inf - -inf).
  a = zeros;
  la = -INFINITY;
  lb = -3.5f;
  GetParam().merge(a.data(), &la, x.data(), &lb, 1, d);
  EXPECT_EQ(a, x);
  EXPECT_EQ(la, -3.5f);
  // Both empty: the result is empty (lse -inf, out still 0).
  a = zeros;
  la = lb = -INFINITY;
  GetParam().merge(a.data(), &la, zeros.data(), &lb, 1, d);
  EXPECT_EQ(a, zeros);
  EXPECT_EQ(la, -INFINITY);
}

TEST_P(MergeStatesTest, MergingDisjointRowSetsEqualsAttendingTheUnion) {
  const int64_t d = 64, group = 4, page_tokens = 16, pages = 6;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> arena(pages * 2 * page_tokens * d * sizeof(bf16));
  for (size_t i = 0; i < arena.size() / sizeof(bf16); ++i) {
    reinterpret_cast<bf16*>(arena.data())[i] = FloatToBf16(normal(rng));
  }
  const PagedKvView kv{arena.data(), 2 * page_tokens * d * sizeof(bf16), page_tokens, d};
  std::vector<float> q(group * d);
  for (float& x : q) x = normal(rng);
  const DecodeQuery query{q.data(), group, 0.125f};
  const std::vector<PageSpan> all = {{0, 0, 16}, {2, 3, 9}, {5, 0, 1}, {4, 0, 16}};
  std::vector<float> whole(group * d), whole_l(group), a(group * d), la(group), b(group * d),
      lb(group);
  reference::PagedAttention(kv, all.data(), all.size(), query, {whole.data(), whole_l.data()});
  reference::PagedAttention(kv, all.data(), 2, query, {a.data(), la.data()});
  reference::PagedAttention(kv, all.data() + 2, 2, query, {b.data(), lb.data()});
  GetParam().merge(a.data(), la.data(), b.data(), lb.data(), group, d);
  EXPECT_LE(reference::RelativeL2Error(a, whole), 1e-6);
  for (int64_t g = 0; g < group; ++g) EXPECT_NEAR(la[g], whole_l[g], 1e-5);
}

INSTANTIATE_TEST_SUITE_P(All, MergeStatesTest,
                         testing::Values(Impl{"Reference", reference::MergeStates},
                                         Impl{"Cpu", cpu::MergeStates}),
                         [](const testing::TestParamInfo<Impl>& info) { return info.param.name; });

}  // namespace
}  // namespace fluxion::kernels
