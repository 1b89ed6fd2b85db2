// CUDA kernels against the reference twins. Skips (does not fail) without a device, so it runs in
// CI as a build check and for real on the lent GPU machine.
#include "kernels/cuda/cuda_ops.h"

#include <cmath>
#include <random>
#include <vector>

#include "common/random_testing.h"
#include "gtest/gtest.h"
#include "kernels/reference/reference_ops.h"
#include "kernels/reference/compare.h"

namespace fluxion::kernels {
namespace {

#define ASSERT_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(expr)

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
  // Copies host data to a new device buffer that TearDown frees.
  float* ToDevice(const std::vector<float>& host) {
    float* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    buffers_.push_back(d);
    return d;
  }
  std::vector<float> ToHost(const float* d, size_t n) {
    std::vector<float> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  void TearDown() override {
    for (float* b : buffers_) cudaFree(b);
  }
  std::vector<float*> buffers_;
};

// This file's data: N(0, 2^2).
std::vector<float> Random(size_t n, uint32_t seed) { return RandomNormal(n, seed, 2.0f); }

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  return kernels::reference::RelativeL2Error(got, want);
}

TEST_F(CudaOpsTest, RmsNormMatchesReference) {
  const int64_t m = 33, d = 896;
  auto x = Random(m * d, 1), w = Random(d, 2);
  std::vector<float> want(m * d);
  reference::RmsNorm(x.data(), w.data(), 1e-6f, want.data(), m, d);
  float* dx = ToDevice(x);
  float* dw = ToDevice(w);
  float* dy = ToDevice(std::vector<float>(m * d, NAN));  // poisoned: every element must be written
  ASSERT_CUDA_OK(cuda::RmsNorm(dx, dw, 1e-6f, dy, m, d, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LT(RelErr(ToHost(dy, m * d), want), 1e-5);
}

TEST_F(CudaOpsTest, SiluMulMatchesReference) {
  const int64_t n = 100003;
  auto g = Random(n, 3), u = Random(n, 4);
  std::vector<float> want(n);
  reference::SiluMul(g.data(), u.data(), want.data(), n);
  float* dg = ToDevice(g);
  float* du = ToDevice(u);
  float* dout = ToDevice(std::vector<float>(n, NAN));
  ASSERT_CUDA_OK(cuda::SiluMul(dg, du, dout, n, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LT(RelErr(ToHost(dout, n), want), 1e-5);
}

}  // namespace
}  // namespace fluxion::kernels
