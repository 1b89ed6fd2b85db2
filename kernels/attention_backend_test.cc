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
// The CUDA backend runs the same grid (attention_backend_testing.h) from device memory in
// kernels/cuda/attention_backend_cuda_test.cc, skipping without a device.
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
#include "kernels/attention_backend_testing.h"
#include "kernels/cpu/attention_backend_cpu.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/cpu/paged_attention_impl.h"
#include "kernels/reference/attention_backend_reference.h"
#include "kernels/reference/compare.h"

namespace fluxion::kernels {
namespace {

using backend_testing::ConformanceBatches;
using backend_testing::ConformanceHeadDims;
using backend_testing::ConformanceHeads;
using backend_testing::ConformanceLayouts;
using backend_testing::ConformanceSeed;
using backend_testing::Layout;
using backend_testing::LayoutName;
using backend_testing::MakeProblem;
using backend_testing::Problem;
using backend_testing::Tolerance;

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
  auto pr = MakeProblem(batch, hq, hkv, d, layout, ConformanceSeed(batch, hq, d));
  const PagedDecodeProblem& p = pr->p;
  std::unique_ptr<AttentionBackend> reference = NewReferenceAttentionBackend();
  const Outputs want = RunOn(*reference, p);
  const Outputs got = RunOn(*backend, p);
  backend_testing::ExpectMatchesReference(*pr, want.out, want.lse, got.out, got.lse,
                                          factory.tolerance);
}

std::string ParamName(const testing::TestParamInfo<Param>& info) {
  const auto& [impl, batch, heads, d, layout] = info.param;
  return Factories()[impl].name + "_B" + std::to_string(batch) + "_Hq" +
         std::to_string(heads.first) + "Hkv" + std::to_string(heads.second) + "_D" +
         std::to_string(d) + "_" + LayoutName(layout);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, AttentionBackendConformance,
    testing::Combine(testing::Range(0, 5), testing::ValuesIn(ConformanceBatches()),
                     testing::ValuesIn(ConformanceHeads()),
                     testing::ValuesIn(ConformanceHeadDims()),
                     testing::ValuesIn(ConformanceLayouts())),
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
