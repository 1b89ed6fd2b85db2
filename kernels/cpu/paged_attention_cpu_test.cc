// Conformance of the CPU paged decode attention against the reference twin, over a grid of
// head_dim, GQA group, page size, page count and sparsity, for every implementation: the public
// (dispatching) functions and each ISA's kernels directly (AVX2, AVX-512, AVX-512-BF16 scores);
// the ones this CPU or build lacks skip. Inputs are bf16 pages filled with random values (never
// zeros) in a real arena layout with gaps between the pages used.
// Tolerance: the K/V values are identical bf16 on both sides; the reference accumulates in double,
// the kernel in fp32 with a different order: relative L2 error <= 2e-6 on the output and absolute
// <= 1e-5 on the log-sum-exp (a wrong row, mask or rescale gives errors of order 1e-1). The
// AVX-512-BF16 kernel rounds q * scale to bf16 first; it is held to the same tolerance against the
// reference run on that rounded query, and against the reference on q itself to the worst-case
// bounds of that rounding (Bf16QueryBound) and to relative L2 error < 1e-2 (typical: 2.5e-3).
#include "kernels/cpu/paged_attention_cpu.h"

#include <cmath>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/impl_testing.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/paged_attention_impl.h"
#include "kernels/cpu/span_rows.h"
#include "kernels/reference/reference_ops.h"
#include "kernels/reference/compare.h"

namespace fluxion::kernels {
namespace {

struct Case {
  int64_t head_dim, group, page_tokens, pages;
  double keep;        // fraction of pages attended (sparsity)
  bool partial_rows;  // spans cover only part of their pages
};

struct Fixture {
  std::vector<uint8_t> arena;
  PagedKvView kv;
  std::vector<PageSpan> spans;
  std::vector<float> q;
};

Fixture Make(const Case& c, uint32_t seed) {
  Fixture f;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t arena_pages = c.pages * 2 + 3;  // the request's pages are scattered in the arena
  f.kv.page_tokens = c.page_tokens;
  f.kv.head_dim = c.head_dim;
  f.kv.page_bytes = 2 * c.page_tokens * c.head_dim * sizeof(bf16) + 64;  // padded pages
  f.arena.resize(arena_pages * f.kv.page_bytes);
  f.kv.arena = f.arena.data();
  auto* base = f.arena.data();
  for (int64_t p = 0; p < arena_pages; ++p) {
    auto* page = reinterpret_cast<bf16*>(base + p * f.kv.page_bytes);
    for (int64_t i = 0; i < 2 * c.page_tokens * c.head_dim; ++i) {
      page[i] = FloatToBf16(normal(rng) * 1.5f);
    }
  }
  std::vector<int32_t> ids(arena_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (int64_t p = 0; p < c.pages; ++p) {
    if (std::uniform_real_distribution<double>(0, 1)(rng) >= c.keep) continue;
    PageSpan s{ids[p], 0, static_cast<int32_t>(c.page_tokens)};
    if (c.partial_rows) {
      s.first_row = static_cast<int32_t>(rng() % c.page_tokens);
      s.rows = 1 + static_cast<int32_t>(rng() % (c.page_tokens - s.first_row));
    }
    f.spans.push_back(s);
  }
  f.q.resize(c.group * c.head_dim);
  for (float& x : f.q) x = normal(rng);
  return f;
}

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  return kernels::reference::RelativeL2Error(got, want);
}

using cpu::impl_testing::Impl;
using cpu::impl_testing::ImplName;

// Readable parameters in gtest's failure messages.
void PrintTo(const Case& c, std::ostream* os) {
  *os << "head_dim " << c.head_dim << ", group " << c.group << ", page_tokens " << c.page_tokens
      << ", pages " << c.pages << ", keep " << c.keep << (c.partial_rows ? ", partial rows" : "");
}

cpu::CpuIsa IsaOf(Impl impl) {
  return impl == Impl::kAvx2     ? cpu::CpuIsa::kAvx2
         : impl == Impl::kAvx512 ? cpu::CpuIsa::kAvx512
                                 : cpu::CpuIsa::kAvx512Bf16;
}

// Bounds on what rounding the scaled query to bf16 (unit roundoff u = 2^-8) can do to one head's
// state, from its rows: every score moves by at most m = u * max_j sum_t |q_t * scale * k_jt|, so
// the log-sum-exp moves by at most m (it is monotone and shifts by c when all scores do), each
// softmax weight p_j by at most p_j * expm1(2m), and since the weights still sum to 1 the output
// by at most expm1(2m) * max_j |v_j - o| in L2.
struct Bf16QueryBound {
  double lse = 0, out = 0;
};

Bf16QueryBound BoundForHead(const PagedKvView& kv, const std::vector<PageSpan>& spans,
                            const float* q, float scale, const float* exact_out) {
  const int64_t d = kv.head_dim;
  double m = 0, spread = 0;
  for (const PageSpan& s : spans) {
    for (int32_t r = s.first_row; r < s.first_row + s.rows; ++r) {
      const bf16* k = kv.keys(s.page) + r * d;
      const bf16* v = kv.values(s.page) + r * d;
      double abs_dot = 0, dist = 0;
      for (int64_t t = 0; t < d; ++t) {
        abs_dot += std::abs(double(q[t]) * scale * Bf16ToFloat(k[t]));
        dist += std::pow(Bf16ToFloat(v[t]) - double(exact_out[t]), 2);
      }
      m = std::max(m, std::ldexp(abs_dot, -8));
      spread = std::max(spread, std::sqrt(dist));
    }
  }
  return {m, std::expm1(2 * m) * spread};
}

class PagedAttentionTest : public ::testing::TestWithParam<std::tuple<Impl, Case>> {
 protected:
  void SetUp() override {
    const Impl impl = std::get<0>(GetParam());
    if (impl == Impl::kDispatched) return;
    std::string why_not;
    kernels_ = cpu::internal::RunnableKernels(IsaOf(impl), &why_not);
    if (kernels_ == nullptr) GTEST_SKIP() << why_not;
    const int64_t d = std::get<1>(GetParam()).head_dim;
    if (d % kernels_->head_dim_multiple != 0) {
      GTEST_SKIP() << "head_dim " << d << " is not a multiple of " << kernels_->head_dim_multiple
                   << " (the dispatcher sends it to the AVX2 kernel)";
    }
  }

  void Attend(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans, const DecodeQuery& q,
              const AttentionState& state) const {
    if (kernels_ == nullptr) {
      cpu::PagedAttention(kv, spans, num_spans, q, state);
    } else {
      kernels_->paged_attention(kv, spans, num_spans, q, state);
    }
  }

  void AttendSplit(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                   const DecodeQuery& q, const AttentionState& state, int threads) const {
    if (kernels_ == nullptr) {
      cpu::PagedAttentionSplit(kv, spans, num_spans, q, state, threads);
    } else {
      cpu::internal::PagedAttentionSplitWith(kernels_->paged_attention, kv, spans, num_spans, q,
                                             state, threads);
    }
  }

  // Whether the kernel this test runs at this head_dim rounds q * scale to bf16.
  bool RoundsQuery(int64_t head_dim) const {
    const cpu::internal::CpuKernels& k =
        kernels_ != nullptr ? *kernels_ : cpu::internal::ActiveKernels();
    return k.rounds_query_to_bf16 && head_dim % k.head_dim_multiple == 0;
  }

  const cpu::internal::CpuKernels* kernels_ = nullptr;  // null: the public functions
};

TEST_P(PagedAttentionTest, MatchesReferenceWithinTolerance) {
  const Case c = std::get<1>(GetParam());
  ASSERT_TRUE(cpu::PagedAttentionSupported(c.head_dim, c.group, c.page_tokens));
  Fixture f = Make(c, 17);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  DecodeQuery q{f.q.data(), c.group, scale};
  std::vector<float> out(c.group * c.head_dim, NAN), lse(c.group, NAN);
  Attend(f.kv, f.spans.data(), f.spans.size(), q, {out.data(), lse.data()});

  std::vector<float> ref_out(out.size()), ref_lse(c.group);
  reference::PagedAttention(f.kv, f.spans.data(), f.spans.size(), q,
                            {ref_out.data(), ref_lse.data()});
  const bool rounds = RoundsQuery(c.head_dim);
  if (rounds) {
    // The accuracy consequence of the rounding, within the bound derived from it.
    for (int64_t g = 0; g < c.group; ++g) {
      const int64_t d = c.head_dim;
      const Bf16QueryBound bound =
          BoundForHead(f.kv, f.spans, f.q.data() + g * d, scale, ref_out.data() + g * d);
      double err = 0;
      for (int64_t t = 0; t < d; ++t) {
        err += std::pow(double(out[g * d + t]) - ref_out[g * d + t], 2);
      }
      EXPECT_LE(std::sqrt(err), bound.out + 1e-5) << "head " << g;
      if (!f.spans.empty()) {
        EXPECT_LE(std::abs(lse[g] - ref_lse[g]), bound.lse + 1e-5) << "head " << g;
      }
    }
    // The bounds above are worst cases (every rounding error aligned). The errors are in fact
    // independent and mostly below u, so a score typically moves by ~2.5e-3 here (logits of std
    // 1.5) and the output by about as much, relatively: measured 2.0e-3 .. 2.6e-3 on this grid.
    const double rel_err = RelErr(out, ref_out);
    RecordProperty("rel_err_vs_unrounded_q", std::to_string(rel_err));
    EXPECT_LT(rel_err, 1e-2);
    // The kernel itself: fp32-exact on the query it actually uses.
    std::vector<float> rounded(f.q.size());
    for (size_t i = 0; i < rounded.size(); ++i) rounded[i] = RoundToBf16(f.q[i] * scale);
    reference::PagedAttention(f.kv, f.spans.data(), f.spans.size(), {rounded.data(), c.group, 1.0f},
                              {ref_out.data(), ref_lse.data()});
  }
  EXPECT_LT(RelErr(out, ref_out), 2e-6);
  for (int64_t g = 0; g < c.group; ++g) {
    if (f.spans.empty()) {
      EXPECT_EQ(lse[g], -INFINITY);
    } else {
      EXPECT_NEAR(lse[g], ref_lse[g], 1e-5);
    }
  }
}

TEST_P(PagedAttentionTest, MergingTwoHalvesEqualsAttendingTheWhole) {
  const Case c = std::get<1>(GetParam());
  Fixture f = Make(c, 23);
  if (f.spans.size() < 2) GTEST_SKIP() << "needs two spans";
  DecodeQuery q{f.q.data(), c.group, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  const size_t half = f.spans.size() / 2;
  std::vector<float> whole(c.group * c.head_dim), whole_lse(c.group);
  std::vector<float> a(whole.size()), a_lse(c.group), b(whole.size()), b_lse(c.group);
  Attend(f.kv, f.spans.data(), f.spans.size(), q, {whole.data(), whole_lse.data()});
  Attend(f.kv, f.spans.data(), half, q, {a.data(), a_lse.data()});
  Attend(f.kv, f.spans.data() + half, f.spans.size() - half, q, {b.data(), b_lse.data()});
  std::vector<float> ref_a = a, ref_a_lse = a_lse;
  cpu::MergeAttentionStates(a.data(), a_lse.data(), b.data(), b_lse.data(), c.group, c.head_dim);
  reference::MergeAttentionStates(ref_a.data(), ref_a_lse.data(), b.data(), b_lse.data(), c.group,
                                  c.head_dim);
  EXPECT_LT(RelErr(a, whole), 2e-6);
  EXPECT_LT(RelErr(a, ref_a), 1e-6);
  for (int64_t g = 0; g < c.group; ++g) EXPECT_NEAR(a_lse[g], whole_lse[g], 1e-5);
}

TEST_P(PagedAttentionTest, SplitAcrossThreadsMatchesSingleThread) {
  const Case c = std::get<1>(GetParam());
  Fixture f = Make(c, 29);
  DecodeQuery q{f.q.data(), c.group, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  std::vector<float> one(c.group * c.head_dim), one_lse(c.group);
  std::vector<float> split(one.size(), NAN), split_lse(c.group, NAN);
  Attend(f.kv, f.spans.data(), f.spans.size(), q, {one.data(), one_lse.data()});
  AttendSplit(f.kv, f.spans.data(), f.spans.size(), q, {split.data(), split_lse.data()}, 3);
  EXPECT_LT(RelErr(split, one), 2e-6);
  for (int64_t g = 0; g < c.group; ++g) {
    if (f.spans.empty()) {
      EXPECT_EQ(split_lse[g], -INFINITY);
    } else {
      EXPECT_NEAR(split_lse[g], one_lse[g], 1e-5);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, PagedAttentionTest,
    ::testing::Combine(
        ::testing::Values(Impl::kDispatched, Impl::kAvx2, Impl::kAvx512, Impl::kAvx512Bf16),
        ::testing::Values(Case{128, 4, 16, 64, 1.0, false},    // Llama-8B head, GQA 4:1, dense
                          Case{128, 4, 16, 256, 0.05, false},  // 5% of pages
                          Case{128, 1, 16, 40, 0.5, true},     // MHA, partial spans (token top-k)
                          Case{64, 7, 16, 33, 0.3, false},     // Qwen2.5-0.5B (14:2) head layout
                          Case{64, 8, 32, 20, 1.0, true},      // 32-token pages
                          Case{96, 2, 64, 9, 1.0, false},      // 64-token pages, head_dim 96
                          Case{80, 3, 16, 12, 1.0, true},      // not a multiple of 32: AVX2 only
                          Case{256, 16, 16, 5, 1.0, false},    // largest head and group
                          Case{32, 4, 16, 3, 0.0, false})),    // nothing selected: empty state
    [](const ::testing::TestParamInfo<std::tuple<Impl, Case>>& info) {
      const Case& c = std::get<1>(info.param);
      return ImplName(std::get<0>(info.param)) + "_d" + std::to_string(c.head_dim) + "_g" +
             std::to_string(c.group) + "_p" + std::to_string(c.page_tokens) + "x" +
             std::to_string(c.pages) + "_keep" + std::to_string(static_cast<int>(c.keep * 100)) +
             (c.partial_rows ? "_partial" : "");
    });

// The public function runs exactly the active table's kernel where the head_dim allows, and the
// AVX2 kernel elsewhere (bit-for-bit: the kernels are deterministic).
// The kernels attend rows in batches gathered across spans: every row once, in span order, no
// batch above kRowBatch rows, empty spans skipped and long spans cut.
TEST(SpanRowsTest, BatchesEveryRowOnceInOrder) {
  constexpr int64_t kHeadDim = 32, kPageTokens = 16;
  const int64_t page_bytes = 2 * kPageTokens * kHeadDim * int64_t{sizeof(bf16)};
  std::vector<uint8_t> arena(8 * page_bytes);
  const PagedKvView kv{arena.data(), static_cast<size_t>(page_bytes), kPageTokens, kHeadDim};
  const std::vector<PageSpan> spans = {{3, 5, 1}, {1, 0, 0}, {0, 2, 3}, {6, 0, 16},
                                       {2, 15, 1}, {5, 4, 12}, {7, 9, 1}};
  std::vector<const bf16*> want_k, want_v;
  for (const PageSpan& sp : spans) {
    for (int32_t r = 0; r < sp.rows; ++r) {
      want_k.push_back(kv.keys(sp.page) + (sp.first_row + r) * kHeadDim);
      want_v.push_back(kv.values(sp.page) + (sp.first_row + r) * kHeadDim);
    }
  }
  cpu::internal::SpanRows rows(kv, spans.data(), static_cast<int64_t>(spans.size()));
  cpu::internal::RowBatch batch;
  std::vector<const bf16*> got_k, got_v;
  int batches = 0;
  while (rows.Next(&batch)) {
    ++batches;
    ASSERT_GT(batch.rows, 0);
    ASSERT_LE(batch.rows, cpu::internal::kRowBatch);
    got_k.insert(got_k.end(), batch.k, batch.k + batch.rows);
    got_v.insert(got_v.end(), batch.v, batch.v + batch.rows);
  }
  EXPECT_EQ(got_k, want_k);
  EXPECT_EQ(got_v, want_v);
  EXPECT_EQ(batches, (static_cast<int64_t>(want_k.size()) + cpu::internal::kRowBatch - 1) /
                         cpu::internal::kRowBatch);
}

TEST(PagedAttentionDispatchTest, RunsTheActiveKernelOrAvx2ForOtherHeadDims) {
  const cpu::internal::CpuKernels& active = cpu::internal::ActiveKernels();
  for (int64_t head_dim : {128, 80}) {
    const Case c{head_dim, 4, 16, 10, 1.0, true};
    Fixture f = Make(c, 31);
    DecodeQuery q{f.q.data(), c.group, 0.125f};
    std::vector<float> got(c.group * c.head_dim), got_lse(c.group);
    std::vector<float> want(got.size()), want_lse(c.group);
    cpu::PagedAttention(f.kv, f.spans.data(), f.spans.size(), q, {got.data(), got_lse.data()});
    const cpu::internal::PagedAttentionFn expected = head_dim % active.head_dim_multiple == 0
                                                         ? active.paged_attention
                                                         : cpu::internal::PagedAttentionAvx2;
    expected(f.kv, f.spans.data(), f.spans.size(), q, {want.data(), want_lse.data()});
    EXPECT_EQ(got, want) << "head_dim " << head_dim << ", active " << cpu::CpuIsaName(active.isa);
    EXPECT_EQ(got_lse, want_lse);
  }
}

TEST(PagedAttentionBatchTest, BatchOfHeadsMatchesOneCallPerHead) {
  std::vector<Fixture> heads;
  for (uint32_t seed = 0; seed < 5; ++seed)
    heads.push_back(Make({64, 4, 16, 40, 0.3, seed % 2 == 1}, seed));
  const int64_t gd = 4 * 64;
  std::vector<float> batch_out(5 * gd, NAN), batch_lse(5 * 4, NAN), one(gd), one_lse(4);
  std::vector<cpu::PagedAttentionTask> tasks;
  for (int i = 0; i < 5; ++i) {
    tasks.push_back({heads[i].kv,
                     heads[i].spans.data(),
                     static_cast<int64_t>(heads[i].spans.size()),
                     {heads[i].q.data(), 4, 0.125f},
                     {&batch_out[i * gd], &batch_lse[i * 4]}});
  }
  cpu::PagedAttentionBatch(tasks.data(), tasks.size(), 2);
  for (int i = 0; i < 5; ++i) {
    cpu::PagedAttention(heads[i].kv, heads[i].spans.data(), heads[i].spans.size(),
                        {heads[i].q.data(), 4, 0.125f}, {one.data(), one_lse.data()});
    std::vector<float> got(batch_out.begin() + i * gd, batch_out.begin() + (i + 1) * gd);
    EXPECT_EQ(got, one) << "head " << i;  // same kernel, same inputs: bit-identical
  }
}

TEST(MergeAttentionStatesTest, TwoEmptyStatesMergeToEmpty) {
  std::vector<float> a(8, 0.0f), b(8, 0.0f), la(1, -INFINITY), lb(1, -INFINITY);
  cpu::MergeAttentionStates(a.data(), la.data(), b.data(), lb.data(), 1, 8);
  EXPECT_EQ(la[0], -INFINITY);
  for (float x : a) EXPECT_EQ(x, 0.0f);
}

TEST(PagedAttentionSupportTest, RejectsShapesTheKernelCannotHold) {
  EXPECT_FALSE(cpu::PagedAttentionSupported(120, 4, 16));  // not a multiple of 16
  EXPECT_FALSE(cpu::PagedAttentionSupported(512, 4, 16));
  EXPECT_FALSE(cpu::PagedAttentionSupported(128, 32, 16));
  EXPECT_FALSE(cpu::PagedAttentionSupported(128, 4, 128));
  EXPECT_TRUE(cpu::PagedAttentionSupported(128, 4, 16));
}

}  // namespace
}  // namespace fluxion::kernels
