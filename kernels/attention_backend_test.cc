// Conformance of every attention backend (kernels/attention_backend.h) against the reference
// backend over a grid: batch sizes 1/3/8, GQA groups 1/2/7/8, head_dim 64/128, and span layouts
// (whole contexts with a partial last page, sparse selections with partial and single-row spans,
// some pairs empty, all pairs empty, long contexts that the CPU backend cuts into pieces). Requests
// have different context lengths; pages are scattered through the arena.
//
// Tolerance (per (request, KV head) pair): K/V are the same bf16 on both sides; the reference
// accumulates in double, the fp32 kernels in float in another order and merge pieces in float:
// relative L2 error <= 5e-6 on the pair's output, absolute <= 2e-5 on each lse. A kernel that
// rounds q * scale to bf16 (AVX-512-BF16 scores) is held to relative L2 < 1e-2 and lse within
// 5e-2 (its own suite in kernels/cpu bounds it tightly). Empty pairs must give exactly lse = -inf
// and out = 0. Outputs start as NaN so that an unwritten one fails.
//
// A CUDA backend joins by adding a Factory entry that skips when there is no device.
#include "kernels/attention_backend.h"

#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/attention_backend_cpu.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/cpu/paged_attention_impl.h"
#include "kernels/reference/attention_backend_reference.h"
#include "kernels/reference/compare.h"

namespace fluxion::kernels {
namespace {

enum class Layout { kWhole, kSparse, kSomeEmpty, kAllEmpty, kLong };

std::string LayoutName(Layout l) {
  switch (l) {
    case Layout::kWhole:
      return "Whole";
    case Layout::kSparse:
      return "Sparse";
    case Layout::kSomeEmpty:
      return "SomeEmpty";
    case Layout::kAllEmpty:
      return "AllEmpty";
    case Layout::kLong:
      return "Long";
  }
  return "Unknown";
}

struct Problem {
  std::vector<uint8_t> arena;
  std::vector<float> q;
  std::vector<int64_t> indptr;
  std::vector<PageSpan> spans;
  PagedDecodeProblem p;
};

// Builds a batch of `batch` requests with contexts of different lengths; each (request, KV head)
// pair owns its own pages, placed at shuffled positions in one arena.
std::unique_ptr<Problem> MakeProblem(int64_t batch, int64_t hq, int64_t hkv, int64_t d,
                                     Layout layout, uint32_t seed) {
  auto pr = std::make_unique<Problem>();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t page_tokens = layout == Layout::kLong ? 64 : 16;
  std::vector<int64_t> contexts(batch);
  for (int64_t r = 0; r < batch; ++r) {
    contexts[r] = layout == Layout::kLong ? 1500 + 97 * r : 1 + (37 * r + 53) % 200;
  }
  std::vector<int64_t> pages_of(batch * hkv);
  int64_t total_pages = 0;
  for (int64_t pair = 0; pair < batch * hkv; ++pair) {
    pages_of[pair] = (contexts[pair / hkv] + page_tokens - 1) / page_tokens;
    total_pages += pages_of[pair];
  }
  const int64_t arena_pages = total_pages + 5;
  std::vector<int32_t> ids(arena_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  PagedKvView kv;
  kv.page_tokens = page_tokens;
  kv.head_dim = d;
  kv.page_bytes = 2 * page_tokens * d * sizeof(bf16) + 64;
  pr->arena.resize(arena_pages * kv.page_bytes);
  for (size_t i = 0; i < pr->arena.size() / sizeof(bf16); ++i) {
    reinterpret_cast<bf16*>(pr->arena.data())[i] = FloatToBf16(normal(rng));
  }
  kv.arena = pr->arena.data();
  pr->q.resize(batch * hq * d);
  for (float& x : pr->q) x = normal(rng) * 1.5f;

  std::bernoulli_distribution keep(0.4), single(0.2), empty_pair(0.4);
  pr->indptr.push_back(0);
  int64_t next_id = 0;
  for (int64_t pair = 0; pair < batch * hkv; ++pair) {
    const int64_t ctx = contexts[pair / hkv];
    const bool empty = layout == Layout::kAllEmpty ||
                       (layout == Layout::kSomeEmpty && (pair == 0 || empty_pair(rng)));
    for (int64_t i = 0; i < pages_of[pair]; ++i) {
      const int32_t page = ids[next_id++];
      const int32_t rows = static_cast<int32_t>(std::min(page_tokens, ctx - i * page_tokens));
      if (empty) continue;
      if (layout == Layout::kSparse || layout == Layout::kSomeEmpty) {
        if (!keep(rng) && i + 1 < pages_of[pair]) continue;  // the newest page always kept
        if (single(rng)) {
          pr->spans.push_back({page, static_cast<int32_t>(rng() % rows), 1});
          continue;
        }
        const int32_t first = static_cast<int32_t>(rng() % rows);
        pr->spans.push_back({page, first, rows - first});
        continue;
      }
      pr->spans.push_back({page, 0, rows});
    }
    pr->indptr.push_back(static_cast<int64_t>(pr->spans.size()));
  }
  PagedDecodeProblem& p = pr->p;
  p.q = pr->q.data();
  p.kv = kv;
  p.span_indptr = pr->indptr.data();
  p.spans = pr->spans.data();
  p.num_spans = static_cast<int64_t>(pr->spans.size());
  p.num_requests = batch;
  p.num_qo_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(d));
  return pr;
}

struct Outputs {
  std::vector<float> out, lse;
};

// Runs `backend` on a copy of `base` with fresh NaN-filled outputs and exactly WorkspaceBytes of
// workspace.
Outputs RunOn(AttentionBackend& backend, const PagedDecodeProblem& base) {
  Outputs o;
  o.out.assign(base.num_requests * base.num_qo_heads * base.head_dim, NAN);
  o.lse.assign(base.num_requests * base.num_qo_heads, NAN);
  PagedDecodeProblem p = base;
  p.out = o.out.data();
  p.lse = o.lse.data();
  EXPECT_TRUE(backend.Supports(p).ok()) << backend.Supports(p);
  std::vector<std::byte> workspace(backend.WorkspaceBytes(p));
  const absl::Status s = backend.Run(p, absl::MakeSpan(workspace));
  EXPECT_TRUE(s.ok()) << s;
  return o;
}

struct Tolerance {
  double out_rel_l2, lse_abs;
};
constexpr Tolerance kFp32Tolerance{5e-6, 2e-5};
constexpr Tolerance kBf16QueryTolerance{1e-2, 5e-2};

// A backend under test: how to make it (nullptr with a reason: skip) and its tolerance.
struct Factory {
  std::string name;
  std::function<std::unique_ptr<AttentionBackend>(std::string* why_not)> make;
  Tolerance tolerance;
};

const cpu::CpuPool& TwoThreads() {
  static const cpu::CpuPool pool(2);
  return pool;
}

std::function<std::unique_ptr<AttentionBackend>(std::string*)> Cpu(const cpu::CpuPool* pool,
                                                                   std::optional<cpu::CpuIsa> isa) {
  return [pool, isa](std::string* why_not) -> std::unique_ptr<AttentionBackend> {
    auto b = cpu::NewCpuAttentionBackend({pool, isa});
    if (!b.ok()) {
      *why_not = std::string(b.status().message());
      return nullptr;
    }
    return *std::move(b);
  };
}

std::vector<Factory> Factories() {
  const bool dispatched_rounds = cpu::internal::ActiveKernels().rounds_query_to_bf16;
  const Tolerance dispatched = dispatched_rounds ? kBf16QueryTolerance : kFp32Tolerance;
  return {
      {"CpuDispatched", Cpu(nullptr, std::nullopt), dispatched},
      {"CpuDispatchedPool2", Cpu(&TwoThreads(), std::nullopt), dispatched},
      {"CpuAvx2Pool2", Cpu(&TwoThreads(), cpu::CpuIsa::kAvx2), kFp32Tolerance},
      {"CpuAvx512Pool2", Cpu(&TwoThreads(), cpu::CpuIsa::kAvx512), kFp32Tolerance},
      {"CpuAvx512Bf16Pool2", Cpu(&TwoThreads(), cpu::CpuIsa::kAvx512Bf16), kBf16QueryTolerance},
  };
}

// (implementation index, batch, (hq, hkv), head_dim, layout)
using Param = std::tuple<int, int64_t, std::pair<int64_t, int64_t>, int64_t, Layout>;

class AttentionBackendConformance : public testing::TestWithParam<Param> {};

TEST_P(AttentionBackendConformance, MatchesReference) {
  const auto& [impl, batch, heads, d, layout] = GetParam();
  const Factory factory = Factories()[impl];
  std::string why_not;
  std::unique_ptr<AttentionBackend> backend = factory.make(&why_not);
  if (backend == nullptr) GTEST_SKIP() << why_not;
  const auto [hq, hkv] = heads;
  auto pr = MakeProblem(batch, hq, hkv, d, layout, 1000 + 7 * batch + hq + d);
  const PagedDecodeProblem& p = pr->p;
  std::unique_ptr<AttentionBackend> reference = NewReferenceAttentionBackend();
  const Outputs want = RunOn(*reference, p);
  const Outputs got = RunOn(*backend, p);
  const int64_t group = hq / hkv;
  for (int64_t pair = 0; pair < p.num_pairs(); ++pair) {
    const int64_t r = pair / hkv, h = pair % hkv;
    const int64_t head0 = r * hq + h * group;
    const bool empty = pr->indptr[pair] == pr->indptr[pair + 1];
    const absl::Span<const float> got_out(got.out.data() + head0 * d, group * d);
    const absl::Span<const float> want_out(want.out.data() + head0 * d, group * d);
    if (empty) {
      for (int64_t g = 0; g < group; ++g) {
        EXPECT_EQ(got.lse[head0 + g], -INFINITY) << "request " << r << " kv head " << h;
      }
      for (float x : got_out) ASSERT_EQ(x, 0.0f) << "request " << r << " kv head " << h;
      continue;
    }
    EXPECT_LE(reference::RelativeL2Error(got_out, want_out), factory.tolerance.out_rel_l2)
        << "request " << r << " kv head " << h;
    for (int64_t g = 0; g < group; ++g) {
      EXPECT_NEAR(got.lse[head0 + g], want.lse[head0 + g], factory.tolerance.lse_abs)
          << "request " << r << " query head " << h * group + g;
    }
  }
}

std::string ParamName(const testing::TestParamInfo<Param>& info) {
  const auto& [impl, batch, heads, d, layout] = info.param;
  return Factories()[impl].name + "_B" + std::to_string(batch) + "_Hq" +
         std::to_string(heads.first) + "Hkv" + std::to_string(heads.second) + "_D" +
         std::to_string(d) + "_" + LayoutName(layout);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, AttentionBackendConformance,
    testing::Combine(testing::Range(0, 5), testing::Values<int64_t>(1, 3, 8),
                     testing::Values(std::pair<int64_t, int64_t>{2, 2},
                                     std::pair<int64_t, int64_t>{4, 2},
                                     std::pair<int64_t, int64_t>{14, 2},
                                     std::pair<int64_t, int64_t>{8, 1}),
                     testing::Values<int64_t>(64, 128),
                     testing::Values(Layout::kWhole, Layout::kSparse, Layout::kSomeEmpty,
                                     Layout::kAllEmpty, Layout::kLong)),
    ParamName);

TEST(CpuAttentionBackendTest, SameResultsForAnyPoolSize) {
  // The pieces are cut by rows, not threads: one and two threads give identical bits.
  auto pr = MakeProblem(3, 14, 2, 64, Layout::kLong, 7);
  const cpu::CpuPool one(1);
  auto a = cpu::NewCpuAttentionBackend({&one, std::nullopt});
  auto b = cpu::NewCpuAttentionBackend({&TwoThreads(), std::nullopt});
  ASSERT_TRUE(a.ok() && b.ok());
  const Outputs x = RunOn(**a, pr->p), y = RunOn(**b, pr->p);
  EXPECT_EQ(x.out, y.out);
  EXPECT_EQ(x.lse, y.lse);
}

TEST(CpuAttentionBackendTest, LongPairsUseWorkspaceWithinTheBound) {
  auto pr = MakeProblem(1, 2, 1, 64, Layout::kLong, 9);
  auto b = cpu::NewCpuAttentionBackend({&TwoThreads(), std::nullopt});
  ASSERT_TRUE(b.ok());
  // 1500 rows of 64-row pages: pieces of >= 512 rows, so 3 partial states merge.
  EXPECT_GT((*b)->WorkspaceBytes(pr->p), 3 * 2 * 64 * sizeof(float));
  EXPECT_EQ(NewReferenceAttentionBackend()->WorkspaceBytes(pr->p), 0u);
}

TEST(CpuAttentionBackendTest, SupportsNamesWhatItLacks) {
  auto pr = MakeProblem(1, 4, 2, 64, Layout::kWhole, 3);
  auto b = cpu::NewCpuAttentionBackend({nullptr, std::nullopt});
  ASSERT_TRUE(b.ok());
  std::vector<float> out(4 * 64), lse(4);
  pr->p.out = out.data();
  pr->p.lse = lse.data();
  PagedDecodeProblem p = pr->p;
  p.num_qo_heads = 64;  // group 32 > kMaxGroup
  EXPECT_EQ((*b)->Supports(p).code(), absl::StatusCode::kUnimplemented) << (*b)->Supports(p);
  p = pr->p;
  p.num_qo_heads = 5;  // not a multiple of num_kv_heads
  EXPECT_EQ((*b)->Supports(p).code(), absl::StatusCode::kInvalidArgument);
  p = pr->p;
  p.head_dim = p.kv.head_dim = 8;
  EXPECT_EQ((*b)->Supports(p).code(), absl::StatusCode::kUnimplemented) << (*b)->Supports(p);
  p = pr->p;
  p.kv.head_dim = 128;
  EXPECT_EQ((*b)->Supports(p).code(), absl::StatusCode::kInvalidArgument);
  p = pr->p;
  p.lse = nullptr;
  EXPECT_EQ((*b)->Supports(p).code(), absl::StatusCode::kInvalidArgument);
  p = pr->p;
  p.num_requests = 0;
  EXPECT_TRUE((*b)->Supports(p).ok());
}

TEST(ReferenceAttentionBackendTest, RejectsBadSpans) {
  auto pr = MakeProblem(2, 4, 2, 64, Layout::kWhole, 5);
  std::vector<float> out(2 * 4 * 64), lse(2 * 4);
  pr->p.out = out.data();
  pr->p.lse = lse.data();
  auto reference = NewReferenceAttentionBackend();
  pr->spans[1].rows = 17;  // past a 16-token page
  EXPECT_EQ(reference->Run(pr->p, {}).code(), absl::StatusCode::kInvalidArgument);
  pr->spans[1].rows = 1;
  pr->indptr[2] = pr->indptr[1] - 1;  // decreasing
  EXPECT_EQ(reference->Run(pr->p, {}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuAttentionBackendTest, UnavailableIsaIsAnError) {
  for (cpu::CpuIsa isa : {cpu::CpuIsa::kAvx512, cpu::CpuIsa::kAvx512Bf16}) {
    std::string why_not;
    if (cpu::internal::RunnableKernels(isa, &why_not) != nullptr) continue;
    EXPECT_EQ(cpu::NewCpuAttentionBackend({nullptr, isa}).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace fluxion::kernels
