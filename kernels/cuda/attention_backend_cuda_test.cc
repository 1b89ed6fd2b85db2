// The conformance suite of kernels/attention_backend_test.cc on the device: every problem of the
// same grid (attention_backend_testing.h) copied to device memory (the arena to device memory or
// to pinned host memory mapped for the device), run by CudaAttentionBackend with each paged
// kernel, copied back and compared with the reference backend on the host. Skips without a device.
//
// Tolerance: the same bf16 K/V; the kernel computes in fp32 with base-2 exponentials of
// pre-scaled scores (q * scale * log2 e) and merges chunk states in fp32, so outputs are held to
// relative L2 <= 2e-5 and lse to 1e-4 absolute (the reference accumulates in double); empty pairs
// must give exactly out 0 and lse -inf, and outputs start as NaN.
#include "kernels/cuda/attention_backend_cuda.h"

#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention_backend_testing.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device_buffers_testing.h"
#include "kernels/reference/attention_backend_reference.h"

namespace fluxion::kernels::cuda {
namespace {

using backend_testing::Layout;
using backend_testing::Problem;

constexpr backend_testing::Tolerance kCudaTolerance{2e-5, 1e-4};

enum class Arena { kDevice, kMappedHost };

// The problem's arrays in device memory (the arena as asked), outputs NaN, and the workspace.
class OnDevice {
 public:
  OnDevice(const Problem& pr, Arena where) : host_arena_(pr.arena) {
    p_ = pr.p;
    if (where == Arena::kDevice) {
      p_.kv.arena = dev_.ToDevice(pr.arena);
    } else {
      EXPECT_EQ(cudaHostRegister(host_arena_.data(), std::max<size_t>(1, host_arena_.size()),
                                 cudaHostRegisterMapped | cudaHostRegisterReadOnly),
                cudaSuccess);
      registered_ = true;
      void* mapped = nullptr;
      EXPECT_EQ(cudaHostGetDevicePointer(&mapped, host_arena_.data(), 0), cudaSuccess);
      p_.kv.arena = static_cast<const uint8_t*>(mapped);
    }
    p_.q = dev_.ToDevice(pr.q);
    p_.span_indptr = dev_.ToDevice(pr.indptr);
    p_.spans = dev_.ToDevice(pr.spans);
    out_ = dev_.ToDevice(std::vector<float>(p_.num_requests * p_.num_qo_heads * p_.head_dim, NAN));
    lse_ = dev_.ToDevice(std::vector<float>(p_.num_requests * p_.num_qo_heads, NAN));
    p_.out = out_;
    p_.lse = lse_;
  }
  ~OnDevice() {
    if (registered_) cudaHostUnregister(host_arena_.data());
  }

  const PagedDecodeProblem& problem() const { return p_; }
  absl::Span<std::byte> Workspace(size_t bytes) {
    return absl::MakeSpan(dev_.ToDevice(std::vector<std::byte>(bytes)), bytes);
  }
  std::vector<float> Out() const {
    return DeviceBuffers::ToHost(out_, p_.num_requests * p_.num_qo_heads * p_.head_dim);
  }
  std::vector<float> Lse() const {
    return DeviceBuffers::ToHost(lse_, p_.num_requests * p_.num_qo_heads);
  }

 private:
  DeviceBuffers dev_;
  std::vector<uint8_t> host_arena_;
  bool registered_ = false;
  PagedDecodeProblem p_;
  float* out_ = nullptr;
  float* lse_ = nullptr;
};

// (arena memory, kernel, batch, (hq, hkv), head_dim, layout): the arena outermost, so every
// device-memory case runs before the first read over PCIe.
using Param = std::tuple<Arena, PagedKernel, int64_t, std::pair<int64_t, int64_t>, int64_t, Layout>;

class CudaAttentionBackendConformance : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaAttentionBackendConformance, MatchesReference) {
  const auto& [where, kernel, batch, heads, d, layout] = GetParam();
  const auto [hq, hkv] = heads;
  auto pr = backend_testing::MakeProblem(batch, hq, hkv, d, layout,
                                         backend_testing::ConformanceSeed(batch, hq, d));
  std::vector<float> want_out(batch * hq * d, NAN), want_lse(batch * hq, NAN);
  PagedDecodeProblem host = pr->p;
  host.out = want_out.data();
  host.lse = want_lse.data();
  ASSERT_TRUE(NewReferenceAttentionBackend()->Run(host, {}).ok());

  auto backend = CudaAttentionBackend::Create({nullptr, kernel, 0});
  ASSERT_TRUE(backend.ok()) << backend.status();
  OnDevice dev(*pr, where);
  const absl::Status supported = (*backend)->Supports(dev.problem());
  if (kernel == PagedKernel::kV3 && pr->p.kv.page_tokens == 64) {
    EXPECT_EQ(supported.code(), absl::StatusCode::kUnimplemented) << supported;
    return;  // v3 has no 64-token pages
  }
  ASSERT_TRUE(supported.ok()) << supported;
  const absl::Status ran =
      (*backend)->Run(dev.problem(), dev.Workspace((*backend)->WorkspaceBytes(dev.problem())));
  ASSERT_TRUE(ran.ok()) << ran;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  backend_testing::ExpectMatchesReference(*pr, want_out, want_lse, dev.Out(), dev.Lse(),
                                          kCudaTolerance);
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto& [where, kernel, batch, heads, d, layout] = info.param;
  return std::string(PagedKernelName(kernel)) +
         (where == Arena::kDevice ? "_Device" : "_MappedHost") + "_B" + std::to_string(batch) +
         "_Hq" + std::to_string(heads.first) + "Hkv" + std::to_string(heads.second) + "_D" +
         std::to_string(d) + "_" + backend_testing::LayoutName(layout);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CudaAttentionBackendConformance,
    ::testing::Combine(::testing::Values(Arena::kDevice, Arena::kMappedHost),
                       ::testing::Values(PagedKernel::kV5, PagedKernel::kV3),
                       ::testing::ValuesIn(backend_testing::ConformanceBatches()),
                       ::testing::ValuesIn(backend_testing::ConformanceHeads()),
                       ::testing::ValuesIn(backend_testing::ConformanceHeadDims()),
                       ::testing::ValuesIn(backend_testing::ConformanceLayouts())),
    ParamName);

// Host-only checks: they need the backend object, so they also skip without a device.
class CudaAttentionBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(CudaAttentionBackendTest, SupportsNamesWhatItLacks) {
  auto pr = backend_testing::MakeProblem(1, 4, 2, 64, Layout::kWhole, 3);
  std::vector<float> out(4 * 64), lse(4);
  pr->p.out = out.data();
  pr->p.lse = lse.data();
  auto v5 = CudaAttentionBackend::Create({});
  auto v3 = CudaAttentionBackend::Create({nullptr, PagedKernel::kV3, 0});
  ASSERT_TRUE(v5.ok() && v3.ok());
  EXPECT_TRUE((*v5)->Supports(pr->p).ok()) << (*v5)->Supports(pr->p);
  PagedDecodeProblem p = pr->p;
  p.num_qo_heads = 32;  // group 16
  EXPECT_EQ((*v5)->Supports(p).code(), absl::StatusCode::kUnimplemented);
  p = pr->p;
  p.head_dim = p.kv.head_dim = 96;
  p.kv.page_bytes = 2 * 16 * 96 * 2;
  EXPECT_EQ((*v5)->Supports(p).code(), absl::StatusCode::kUnimplemented);
  p = pr->p;
  p.kv.page_bytes += 8;  // rows no longer 16-byte aligned
  EXPECT_EQ((*v5)->Supports(p).code(), absl::StatusCode::kUnimplemented);
  p = pr->p;
  p.kv.page_tokens = 64;
  p.kv.page_bytes = 2 * 64 * 64 * 2;
  EXPECT_TRUE((*v5)->Supports(p).ok());
  EXPECT_EQ((*v3)->Supports(p).code(), absl::StatusCode::kUnimplemented);
  p.kv.page_tokens = 24;
  EXPECT_EQ((*v5)->Supports(p).code(), absl::StatusCode::kUnimplemented);
  p = pr->p;
  p.num_qo_heads = 5;
  EXPECT_EQ((*v5)->Supports(p).code(), absl::StatusCode::kInvalidArgument);
}

// Host-only: runs without a device too.
TEST(CudaAttentionPlanTest, ChunkPlanFillsOneWaveAndBoundsTheWorkspace) {
  PagedDecodeProblem p;
  p.num_requests = 1;
  p.num_qo_heads = 32;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.kv.page_tokens = 16;
  p.num_spans = 8 * 2048;  // 32K tokens per KV head
  // 264 slots over 8 pairs: 33 chunks per pair of 2048 spans -> 63 spans (1008 rows) each.
  EXPECT_EQ(CudaAttentionSpansPerChunk(p, 264), 63);
  p.num_requests = 64;  // 512 pairs: one chunk each, at least 256 rows
  p.num_spans = 512 * 10;
  EXPECT_EQ(CudaAttentionSpansPerChunk(p, 264), 16);
  EXPECT_GE(CudaAttentionWorkspaceBytes(p, 16),
            (p.num_spans / 16 + p.num_pairs()) * 4 * (128 + 1) * sizeof(float));
  p.kv.page_tokens = 64;  // 256 rows = 4 spans at least
  p.num_spans = 512;
  EXPECT_EQ(CudaAttentionSpansPerChunk(p, 264), 4);
  p.num_spans = 0;
  EXPECT_EQ(CudaAttentionSpansPerChunk(p, 264), 4);
  p.num_requests = 0;
  EXPECT_EQ(CudaAttentionWorkspaceBytes(p, 4), 0u);
}

// The bound on chunks holds for every split of the spans over the pairs: sum over pairs of
// ceil(n / K) <= num_spans / K + pairs.
TEST(CudaAttentionPlanTest, ChunkBoundHoldsForUnevenPairs) {
  for (int64_t k : {1, 3, 16, 63}) {
    for (const std::vector<int64_t>& counts :
         {std::vector<int64_t>{0, 0, 0}, {1, 1, 1}, {62, 1, 0, 127}, {5000, 0, 1}, {63, 63}}) {
      int64_t spans = 0, chunks = 0;
      for (int64_t n : counts) {
        spans += n;
        chunks += (n + k - 1) / k;
      }
      EXPECT_LE(chunks, spans / k + static_cast<int64_t>(counts.size()));
    }
  }
}

// More pairs than the plan kernel has threads (1024): each thread plans several pairs.
TEST_F(CudaAttentionBackendTest, ManyPairsMatchTheReference) {
  auto pr = backend_testing::MakeProblem(300, 8, 4, 64, Layout::kSomeEmpty, 11);
  ASSERT_GT(pr->p.num_pairs(), 1024);
  std::vector<float> want_out(300 * 8 * 64, NAN), want_lse(300 * 8, NAN);
  PagedDecodeProblem host = pr->p;
  host.out = want_out.data();
  host.lse = want_lse.data();
  ASSERT_TRUE(NewReferenceAttentionBackend()->Run(host, {}).ok());
  for (PagedKernel kernel : {PagedKernel::kV5, PagedKernel::kV3}) {
    auto backend = CudaAttentionBackend::Create({nullptr, kernel, 0});
    ASSERT_TRUE(backend.ok()) << backend.status();
    OnDevice dev(*pr, Arena::kDevice);
    const absl::Status ran =
        (*backend)->Run(dev.problem(), dev.Workspace((*backend)->WorkspaceBytes(dev.problem())));
    ASSERT_TRUE(ran.ok()) << ran;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    backend_testing::ExpectMatchesReference(*pr, want_out, want_lse, dev.Out(), dev.Lse(),
                                            kCudaTolerance);
  }
}

TEST_F(CudaAttentionBackendTest, WorkspaceTooSmallIsAnError) {
  auto pr = backend_testing::MakeProblem(2, 4, 2, 64, Layout::kWhole, 5);
  auto backend = CudaAttentionBackend::Create({});
  ASSERT_TRUE(backend.ok());
  OnDevice dev(*pr, Arena::kDevice);
  const size_t need = (*backend)->WorkspaceBytes(dev.problem());
  ASSERT_GT(need, 0u);
  EXPECT_EQ((*backend)->Run(dev.problem(), dev.Workspace(need - 1)).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::kernels::cuda
