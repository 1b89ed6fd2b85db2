// The CUDA resident window against the host one (the stand-in the hybrid executor is tested with
// on the CPU) on the same pages and steps: admission from host pages, ring appends that wrap,
// dense attention over the valid rows, and the merge of host partial states. Skips without a
// CUDA device.
#include "decode/cuda_resident_window.h"

#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <random>

#include "decode/kv_arena.h"
#include "decode/paged_kv.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device_buffers_testing.h"

namespace fluxion::decode {
namespace {

using kernels::cuda::DeviceBuffers;

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::vector<float> Random(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

void ExpectNear(const std::vector<float>& a, const std::vector<float>& b, float tol,
                const char* what) {
  ASSERT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      EXPECT_EQ(a[i], b[i]) << what << " at " << i;
      continue;
    }
    worst = std::max(worst, std::abs(a[i] - b[i]) / (1.0f + std::abs(b[i])));
  }
  EXPECT_LT(worst, tol) << what;
}

class CudaResidentWindowTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(CudaResidentWindowTest, MatchesTheHostWindowStepByStep) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const int64_t d = GetParam();
  WindowShape shape;
  shape.num_layers = 2;
  shape.num_heads = 8;
  shape.num_kv_heads = 2;
  shape.head_dim = d;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(d));
  shape.sink_tokens = 4;
  shape.window_tokens = 16;  // small, so the ring wraps within a few steps
  shape.max_requests = 4;
  shape.max_rows = 4;
  const int64_t page_tokens = 16;
  const KvShape kv_shape{shape.num_layers, shape.num_kv_heads, d, page_tokens};
  auto arena = *KvArena::Create(kv_shape.page_bytes(), 1024);

  std::mt19937 rng(7);
  const std::vector<int64_t> lengths = {3, 19, 100};  // inside sinks, just past them, wrapped
  std::vector<std::unique_ptr<PagedKv>> kvs;
  for (int64_t n : lengths) {
    auto kv = *PagedKv::Create(arena.get(), kv_shape);
    const int64_t row = shape.num_kv_heads * d;
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const std::vector<float> k = Random(n * row, rng), v = Random(n * row, rng);
      ASSERT_TRUE(kv->Append(layer, n, k.data(), v.data(), row).ok());
    }
    kvs.push_back(std::move(kv));
  }

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto host = *NewHostResidentWindow(shape, page_tokens);
  auto cuda = NewCudaResidentWindow(shape, stream);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  std::vector<int> host_slots, cuda_slots;
  for (const auto& kv : kvs) {
    host_slots.push_back(*host->Admit(*kv));
    auto slot = (*cuda)->Admit(*kv);
    ASSERT_TRUE(slot.ok()) << slot.status();
    cuda_slots.push_back(*slot);
  }
  std::vector<int64_t> positions = lengths;
  const int64_t rows = static_cast<int64_t>(lengths.size());
  const int64_t q_n = rows * shape.num_heads * d, kv_n = rows * shape.num_kv_heads * d;
  DeviceBuffers dev;
  float* out_dev = dev.ToDevice(std::vector<float>(q_n));
  for (int step = 0; step < 24; ++step) {
    ASSERT_TRUE(host->BeginStep(host_slots, positions).ok());
    ASSERT_TRUE((*cuda)->BeginStep(cuda_slots, positions).ok());
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const std::vector<float> q = Random(q_n, rng), k = Random(kv_n, rng), v = Random(kv_n, rng);
      std::vector<float> host_out(q_n);
      host->AppendAndAttend(layer, q.data(), k.data(), v.data(), host_out.data());
      (*cuda)->AppendAndAttend(layer, dev.ToDevice(q), dev.ToDevice(k), dev.ToDevice(v), out_dev);
      // A host partial state to merge in; every third state empty (lse -inf).
      const std::vector<float> part_out = Random(q_n, rng);
      std::vector<float> part_lse = Random(rows * shape.num_heads, rng);
      for (size_t i = 0; i < part_lse.size(); i += 3) {
        part_lse[i] = -std::numeric_limits<float>::infinity();
      }
      host->MergeHostStates(part_out.data(), part_lse.data(), host_out.data());
      (*cuda)->MergeHostStates(part_out.data(), part_lse.data(), out_dev);
      ASSERT_TRUE((*cuda)->Sync().ok());
      ExpectNear(DeviceBuffers::ToHost(out_dev, q_n), host_out, 1e-4f, "merged output");
    }
    for (int64_t& p : positions) ++p;
  }
  cuda->reset();
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaResidentWindowTest, ::testing::Values(64, 128));

TEST(CudaResidentWindowShapeTest, RefusesWhatItCannotHold) {
  WindowShape shape;
  shape.num_layers = 1;
  shape.num_heads = 4;
  shape.num_kv_heads = 1;
  shape.head_dim = 96;
  shape.scale = 0.1f;
  EXPECT_EQ(NewCudaResidentWindow(shape, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  shape.head_dim = 64;
  shape.window_tokens = 300;
  EXPECT_EQ(NewCudaResidentWindow(shape, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::decode
