// The candidate kernel (sampling.h) against a CPU reference: exact ids and logits, the normaliser
// to double rounding. Skips without a device; the timing case prints the kernel's time at Llama-3
// shapes beside the D2H copy of the full logits it replaces.
#include "kernels/cuda/sampling.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device_buffers_testing.h"

namespace fluxion::kernels::cuda {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Reference {
  std::vector<int32_t> ids;
  std::vector<float> values;
  std::vector<double> normalisers;
};

// The sampler's order (descending, ties by lower id; -0 == +0) by a full sort of each row.
Reference CpuTopCandidates(const std::vector<float>& x, int64_t rows, int64_t vocab, int64_t k,
                           const std::vector<double>& temperatures) {
  Reference r;
  const int64_t n = std::min(k, vocab);
  for (int64_t row = 0; row < rows; ++row) {
    const float* v = x.data() + row * vocab;
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
    for (int64_t i = 0; i < n; ++i) {
      r.ids.push_back(order[i]);
      r.values.push_back(v[order[i]]);
    }
    double sum = 0;
    const double t = temperatures[row];
    if (t > 0) {
      for (int64_t i = 0; i < vocab; ++i) sum += std::exp((double{v[i]} - v[order[0]]) / t);
    }
    r.normalisers.push_back(sum);
  }
  return r;
}

class SamplingKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }

  // Runs the kernel and checks it against the reference.
  void Check(const std::vector<float>& x, int64_t rows, int64_t vocab, int64_t k,
             const std::string& what) {
    std::vector<double> temps(rows);
    for (int64_t r = 0; r < rows; ++r) temps[r] = r % 3 == 2 ? 0.0 : 0.5 + r;
    DeviceBuffers mem;
    const int64_t n = std::min(k, vocab);
    float* d_x = mem.ToDevice(x);
    double* d_t = mem.ToDevice(temps);
    int32_t* d_ids = mem.ToDevice(std::vector<int32_t>(rows * n, -1));
    float* d_values = mem.ToDevice(std::vector<float>(rows * n));
    double* d_norm = mem.ToDevice(std::vector<double>(rows));
    ASSERT_EQ(TopCandidates(d_x, rows, vocab, k, d_t, d_ids, d_values, d_norm, nullptr),
              cudaSuccess)
        << what;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    const Reference want = CpuTopCandidates(x, rows, vocab, k, temps);
    const std::vector<int32_t> ids = DeviceBuffers::ToHost(d_ids, rows * n);
    const std::vector<float> values = DeviceBuffers::ToHost(d_values, rows * n);
    const std::vector<double> norms = DeviceBuffers::ToHost(d_norm, rows);
    for (int64_t i = 0; i < rows * n; ++i) {
      ASSERT_EQ(ids[i], want.ids[i]) << what << " row " << i / n << " rank " << i % n;
      ASSERT_EQ(std::memcmp(&values[i], &want.values[i], sizeof(float)), 0)
          << what << " row " << i / n << " rank " << i % n;
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (!std::isfinite(want.normalisers[r])) continue;
      EXPECT_NEAR(norms[r], want.normalisers[r], 1e-10 * std::max(1.0, want.normalisers[r]))
          << what << " row " << r;
    }
  }
};

// Values on a coarse grid (many ties), some -inf, -0 and +0 both present.
std::vector<float> TiedLogits(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> x(n);
  for (float& v : x) v = std::round(normal(rng) * 4.0f) / 4.0f;
  for (int64_t i = 0; i < n / 50 + 1; ++i) x[rng() % n] = -kInf;
  for (int64_t i = 0; i < n / 50 + 1; ++i) x[rng() % n] = (rng() & 1) ? -0.0f : 0.0f;
  return x;
}

std::vector<float> DistinctLogits(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

TEST_F(SamplingKernelTest, MatchesTheReferenceOnTiesInfinitiesAndOddVocabularies) {
  for (int64_t vocab : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{1024}, int64_t{5001},
                        int64_t{32000}}) {
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{40}, int64_t{1000}, kMaxTopCandidates}) {
      const int64_t rows = 4;
      const std::string what = "vocab " + std::to_string(vocab) + " k " + std::to_string(k);
      Check(TiedLogits(rows * vocab, vocab * 31 + k), rows, vocab, k, "tied " + what);
      Check(DistinctLogits(rows * vocab, vocab * 17 + k), rows, vocab, k, "distinct " + what);
    }
  }
}

// Rows whose top bin is crowded (more than the fast path's 4096 keys) take the general path.
TEST_F(SamplingKernelTest, RowsOfEqualValuesGiveTheLowestIds) {
  const int64_t rows = 3, vocab = 10000;
  std::vector<float> x(rows * vocab, 1.5f);
  std::fill(x.begin() + vocab, x.begin() + 2 * vocab, -kInf);  // a row of -inf: ties as well
  std::fill(x.begin() + 2 * vocab, x.end(), 0.0f);
  x[2 * vocab + 9999] = -0.0f;  // ties +0
  for (int64_t k : {int64_t{1}, int64_t{37}, kMaxTopCandidates}) {
    Check(x, rows, vocab, k, "equal k " + std::to_string(k));
  }
}

TEST_F(SamplingKernelTest, CrowdedRowsOfDistinctValuesTakeTheGeneralPathExactly) {
  const int64_t rows = 3, vocab = 50000;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> near_one(1.0f, 1.06f);  // one bin of the fast path
  std::vector<float> x(rows * vocab);
  for (float& v : x) v = near_one(rng);
  for (int64_t k : {int64_t{1}, int64_t{37}, kMaxTopCandidates}) {
    Check(x, rows, vocab, k, "crowded k " + std::to_string(k));
  }
}

TEST_F(SamplingKernelTest, LlamaVocabularyAndItsTime) {
  const int64_t rows = 16, vocab = 128256;
  const std::vector<float> x = DistinctLogits(rows * vocab, 3);
  Check(x, rows, vocab, kMaxTopCandidates, "llama k 1024");
  Check(TiedLogits(rows * vocab, 4), rows, vocab, 50, "llama tied k 50");

  DeviceBuffers mem;
  float* d_x = mem.ToDevice(x);
  double* d_t = mem.ToDevice(std::vector<double>(rows, 0.8));
  int32_t* d_ids = mem.ToDevice(std::vector<int32_t>(rows * kMaxTopCandidates));
  float* d_values = mem.ToDevice(std::vector<float>(rows * kMaxTopCandidates));
  double* d_norm = mem.ToDevice(std::vector<double>(rows));
  cudaEvent_t start, stop;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
  auto time_ms = [&](auto body) {
    for (int i = 0; i < 3; ++i) body();
    cudaEventRecord(start);
    constexpr int kRepeats = 20;
    for (int i = 0; i < kRepeats; ++i) body();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    return ms / kRepeats;
  };
  for (int64_t k : {int64_t{1}, int64_t{50}, kMaxTopCandidates}) {
    const float ms = time_ms([&] {
      TopCandidates(d_x, rows, vocab, k, d_t, d_ids, d_values, d_norm, nullptr);
    });
    std::printf("candidates [%ld][%ld] k=%ld: %.1f us\n", rows, vocab, k, ms * 1e3);
  }
  std::vector<float> pageable(rows * vocab);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, rows * vocab * sizeof(float)), cudaSuccess);
  const float pageable_ms = time_ms([&] {
    cudaMemcpy(pageable.data(), d_x, rows * vocab * sizeof(float), cudaMemcpyDeviceToHost);
  });
  const float pinned_ms = time_ms([&] {
    cudaMemcpy(pinned, d_x, rows * vocab * sizeof(float), cudaMemcpyDeviceToHost);
  });
  std::printf("full logits D2H [%ld][%ld] (%.1f MB): pageable %.1f us, pinned %.1f us\n", rows,
              vocab, rows * vocab * 4 / 1e6, pageable_ms * 1e3, pinned_ms * 1e3);
  cudaFreeHost(pinned);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

TEST_F(SamplingKernelTest, RejectsSizesOutOfContract) {
  EXPECT_EQ(TopCandidates(nullptr, 1, 10, 0, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(TopCandidates(nullptr, 1, 10, kMaxTopCandidates + 1, nullptr, nullptr, nullptr,
                          nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(TopCandidates(nullptr, 1, 0, 1, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(TopCandidates(nullptr, 0, 10, 1, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaSuccess);
}

}  // namespace
}  // namespace fluxion::kernels::cuda
