// cuBLAS bf16 GEMM against the fp32 reference on the same bf16-rounded operands.
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"

#include <iostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device_buffers_testing.h"
#include "kernels/reference/compare.h"
#include "kernels/reference/reference_ops.h"

namespace fluxion::kernels::cuda {
namespace {

TEST(GemmTest, Bf16ProductsMatchTheReferenceOnRoundedOperands) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<Gemm>> gemm = Gemm::Create(nullptr);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  DeviceBuffers dev;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  // Decode-sized products (m = batch) and one odd shape.
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 6144, 4096},
                         {16, 1024, 4096}, {5, 333, 257}}) {
    std::vector<bf16> x(m * k), w(n * k);
    std::vector<float> xf(m * k), wf(n * k);
    for (size_t i = 0; i < x.size(); ++i) xf[i] = Bf16ToFloat(x[i] = FloatToBf16(dist(rng)));
    for (size_t i = 0; i < w.size(); ++i) wf[i] = Bf16ToFloat(w[i] = FloatToBf16(dist(rng)));
    std::vector<float> want(m * n, 0.5f);
    reference::MatMul(xf.data(), wf.data(), nullptr, want.data(), m, n, k, /*accumulate=*/true);
    float* y = dev.ToDevice(std::vector<float>(m * n, 0.5f));
    ASSERT_TRUE((*gemm)->MatMulBf16(dev.ToDevice(x), dev.ToDevice(w), y, m, n, k,
                                    /*accumulate=*/true).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(reference::RelativeL2Error(DeviceBuffers::ToHost(y, m * n), want), 1e-5)
        << m << "x" << n << "x" << k;
  }
  EXPECT_EQ((*gemm)->MatMulBf16(nullptr, nullptr, nullptr, 0, 1, 1).code(),
            absl::StatusCode::kInvalidArgument);
}

// The GEMV kernel (a tuner candidate) against the reference on the same bf16 operands, for every
// row count it takes, with and without accumulation, at a column count that is no multiple of its
// 8 columns a block and a k that is no multiple of its 4 x 32 x 8 elements a pass; and its
// refusals.
TEST(GemvTest, MatchesTheReferenceForEveryRowCount) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffers dev;
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int64_t n = 1003, k = 4096 + 264;
  std::vector<bf16> w(n * k);
  std::vector<float> wf(n * k);
  for (size_t i = 0; i < w.size(); ++i) wf[i] = Bf16ToFloat(w[i] = FloatToBf16(dist(rng)));
  const bf16* dw = dev.ToDevice(w);
  for (int64_t m = 1; m <= kMaxGemvRows; ++m) {
    std::vector<bf16> x(m * k);
    std::vector<float> xf(m * k);
    for (size_t i = 0; i < x.size(); ++i) xf[i] = Bf16ToFloat(x[i] = FloatToBf16(dist(rng)));
    const bf16* dx = dev.ToDevice(x);
    for (bool accumulate : {false, true}) {
      std::vector<float> want(m * n, 0.5f);
      reference::MatMul(xf.data(), wf.data(), nullptr, want.data(), m, n, k, accumulate);
      float* y = dev.ToDevice(std::vector<float>(m * n, 0.5f));
      ASSERT_EQ(GemvBf16(dx, dw, y, m, n, k, accumulate, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_LT(reference::RelativeL2Error(DeviceBuffers::ToHost(y, m * n), want), 1e-5)
          << "m " << m << " accumulate " << accumulate;
    }
  }
  float* y = dev.ToDevice(std::vector<float>(16));
  EXPECT_EQ(GemvBf16(nullptr, dw, y, kMaxGemvRows + 1, n, k, false, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(GemvBf16(nullptr, dw, y, 1, n, 12, false, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // refused before any launch
}

// The tuned choice (gemm.h: cuBLASLt candidates timed against cublasGemmEx's default at the first
// product of a shape) computes the untuned product at the decode shapes, accumulating or not, on
// the first call (the one that tunes) and after; the choices are printed (the device run's log
// says which algorithm each shape got and how fast).
TEST(GemmTest, TunedChoiceMatchesTheDefaultAtDecodeShapes) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<Gemm>> tuned = Gemm::Create(nullptr);
  absl::StatusOr<std::unique_ptr<Gemm>> plain = Gemm::Create(nullptr, 32 << 20, /*tune=*/false);
  ASSERT_TRUE(tuned.ok()) << tuned.status();
  ASSERT_TRUE(plain.ok()) << plain.status();
  DeviceBuffers dev;
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 6144, 4096},
                         {4, 4096, 4096}, {16, 28672, 4096}, {16, 4096, 14336}, {3, 333, 257}}) {
    std::vector<bf16> x(m * k), w(n * k);
    for (auto& v : x) v = FloatToBf16(dist(rng));
    for (auto& v : w) v = FloatToBf16(0.05f * dist(rng));
    const std::vector<float> y0(m * n, 0.25f);
    const bf16* dx = dev.ToDevice(x);
    const bf16* dw = dev.ToDevice(w);
    for (bool accumulate : {false, true}) {
      float* want = dev.ToDevice(y0);
      ASSERT_TRUE((*plain)->MatMulBf16(dx, dw, want, m, n, k, accumulate).ok());
      for (int call = 0; call < 2; ++call) {
        float* got = dev.ToDevice(y0);
        ASSERT_TRUE((*tuned)->MatMulBf16(dx, dw, got, m, n, k, accumulate).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_LT(reference::RelativeL2Error(DeviceBuffers::ToHost(got, m * n),
                                             DeviceBuffers::ToHost(want, m * n)),
                  1e-5)
            << m << "x" << n << "x" << k << " accumulate " << accumulate << " call " << call;
      }
    }
  }
  for (const std::string& line : (*tuned)->Choices()) std::cout << "gemm choice: " << line << "\n";
  EXPECT_EQ((*tuned)->Choices().size(), 10u);
}

}  // namespace
}  // namespace fluxion::kernels::cuda
