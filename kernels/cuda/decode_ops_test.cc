// The decode step's CUDA kernels against the reference twins (kernels/reference). Skips without
// a device, so CI builds it and the lent GPU machine runs it.
#include "kernels/cuda/decode_ops.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "common/half.h"
#include "common/random_testing.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device_buffers_testing.h"
#include "kernels/paged_attention.h"
#include "kernels/reference/compare.h"
#include "kernels/reference/reference_ops.h"

namespace fluxion::kernels::cuda {
namespace {

#define ASSERT_CUDA_OK(expr)                                \
  do {                                                      \
    cudaError_t _e = (expr);                                \
    ASSERT_EQ(_e, cudaSuccess) << cudaGetErrorString(_e);   \
  } while (0)

class DecodeOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
  DeviceBuffers dev_;
};

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  return reference::RelativeL2Error(got, want);
}

TEST_F(DecodeOpsTest, EmbedRowsGathersTheRowsAsFloat) {
  const int64_t vocab = 301, d = 96;
  const std::vector<bf16> table = ToBf16(RandomNormal(vocab * d, 1));
  const std::vector<int32_t> ids = {0, 300, 7, 7, 150};
  std::vector<float> want;
  for (int32_t id : ids) {
    for (int64_t j = 0; j < d; ++j) want.push_back(Bf16ToFloat(table[id * d + j]));
  }
  float* out = dev_.ToDevice(std::vector<float>(want.size(), NAN));
  ASSERT_CUDA_OK(EmbedRows(dev_.ToDevice(table), dev_.ToDevice(ids), out, ids.size(), d, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(DeviceBuffers::ToHost(out, want.size()), want);
}

TEST_F(DecodeOpsTest, RopeMatchesReferenceAtLongPositions) {
  const int64_t n = 5, heads = 8, head_dim = 128;
  std::vector<float> x = RandomNormal(n * heads * head_dim, 2);
  const std::vector<int64_t> positions = {0, 1, 4095, 65537, 131071};
  std::vector<float> inv_freq(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(std::pow(500000.0, -2.0 * i / head_dim));
  }
  std::vector<float> want = x;
  reference::ApplyRope(want.data(), positions.data(), inv_freq.data(), n, heads, head_dim);
  float* dx = dev_.ToDevice(x);
  ASSERT_CUDA_OK(ApplyRope(dx, dev_.ToDevice(positions), dev_.ToDevice(inv_freq), n, heads,
                           head_dim, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LT(RelErr(DeviceBuffers::ToHost(dx, x.size()), want), 1e-6);
}

TEST_F(DecodeOpsTest, AddCastAndArgmax) {
  const int64_t n = 70001;
  const std::vector<float> a = RandomNormal(n, 3), b = RandomNormal(n, 4);
  float* da = dev_.ToDevice(a);
  ASSERT_CUDA_OK(AddInPlace(da, dev_.ToDevice(b), n, nullptr));
  bf16* cast = dev_.ToDevice(std::vector<bf16>(n));
  ASSERT_CUDA_OK(CastToBf16(da, cast, n, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> sum = DeviceBuffers::ToHost(da, n);
  const std::vector<bf16> cast_host = DeviceBuffers::ToHost(cast, n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(sum[i], a[i] + b[i]) << i;
    ASSERT_EQ(cast_host[i].bits, FloatToBf16(sum[i]).bits) << i;
  }

  // Rows with a unique maximum, a tie (the lowest index wins) and a maximum in the last column.
  const int64_t rows = 4, vocab = 128256;
  std::vector<float> logits = RandomNormal(rows * vocab, 5);
  logits[0 * vocab + 12345] = 50.0f;
  logits[1 * vocab + 77] = 60.0f;
  logits[1 * vocab + 76000] = 60.0f;
  logits[2 * vocab + vocab - 1] = 70.0f;
  std::vector<int32_t> want(rows);
  for (int64_t r = 0; r < rows; ++r) {
    want[r] = static_cast<int32_t>(
        std::max_element(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab) -
        (logits.begin() + r * vocab));
  }
  int32_t* out = dev_.ToDevice(std::vector<int32_t>(rows, -7));
  ASSERT_CUDA_OK(ArgmaxRows(dev_.ToDevice(logits), rows, vocab, out, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(DeviceBuffers::ToHost(out, rows), want);
  EXPECT_EQ(want[1], 77);
}

// The bias epilogue of CudaDenseOps::MatMul: every row gets the same bias vector (fp32 adds, so
// exact against the host's).
TEST_F(DecodeOpsTest, AddBiasRowsAddsTheBiasToEveryRow) {
  const int64_t m = 7, n = 1000;
  const std::vector<float> y = RandomNormal(m * n, 11), bias = RandomNormal(n, 12);
  float* dy = dev_.ToDevice(y);
  ASSERT_CUDA_OK(AddBiasRows(dy, dev_.ToDevice(bias), m, n, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = DeviceBuffers::ToHost(dy, y.size());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) ASSERT_EQ(got[i * n + j], y[i * n + j] + bias[j]) << i << j;
  }
}

// Random device weights: the same seed gives the same values, another seed others; mean and
// standard deviation as asked (uniform, so |w - mean| <= sqrt(3) std_dev).
TEST_F(DecodeOpsTest, FillRandomBf16IsSeededWithTheAskedMoments) {
  const int64_t n = 1 << 20;
  const float sd = 0.02f;
  std::vector<bf16*> w;
  for (int i = 0; i < 4; ++i) w.push_back(dev_.ToDevice(std::vector<bf16>(n)));
  ASSERT_CUDA_OK(FillRandomBf16(w[0], n, 7, 0.0f, sd, nullptr));
  ASSERT_CUDA_OK(FillRandomBf16(w[1], n, 7, 0.0f, sd, nullptr));
  ASSERT_CUDA_OK(FillRandomBf16(w[2], n, 8, 0.0f, sd, nullptr));
  ASSERT_CUDA_OK(FillRandomBf16(w[3], n, 9, 1.0f, sd, nullptr));  // norm gains
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::vector<bf16>> h;
  for (bf16* d : w) h.push_back(DeviceBuffers::ToHost(d, n));
  double sum = 0, sq = 0, sum_gain = 0;
  int64_t same_as_other_seed = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(h[0][i].bits, h[1][i].bits) << i;
    same_as_other_seed += h[0][i].bits == h[2][i].bits;
    const double v = Bf16ToFloat(h[0][i]);
    ASSERT_LE(std::abs(v), 1.7321 * sd * 1.01) << i;
    sum += v;
    sq += v * v;
    sum_gain += Bf16ToFloat(h[3][i]);
  }
  EXPECT_NEAR(sum / n, 0.0, 1e-4);
  EXPECT_NEAR(std::sqrt(sq / n), sd, 0.01 * sd);
  EXPECT_NEAR(sum_gain / n, 1.0, 1e-3);
  EXPECT_LT(same_as_other_seed, n / 50);  // ~600 bf16 values in range: a few repeat by chance
}

// Window attention against reference::PagedAttention over the same rows laid out as one page
// (K then V, page_tokens = rows), for several problems at once, with an empty window among them.
TEST_F(DecodeOpsTest, WindowAttentionMatchesReferenceWithLse) {
  for (int64_t head_dim : {64, 128}) {
    const int64_t group = 4;
    const std::vector<int32_t> rows_per_problem = {68, 1, 0, 129, 300};
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    std::vector<WindowProblem> problems;
    std::vector<std::vector<float>> want_out, want_lse;
    std::vector<float*> outs, lses;
    uint32_t seed = 10;
    for (int32_t rows : rows_per_problem) {
      // One page: K [rows][head_dim] then V [rows][head_dim], bf16.
      const int64_t tokens = std::max<int32_t>(rows, 1);
      std::vector<bf16> page = ToBf16(RandomNormal(2 * tokens * head_dim, seed++, 2.0f));
      std::vector<float> q = RandomNormal(group * head_dim, seed++);
      std::vector<float> out(group * head_dim), lse(group);
      PagedKvView view{reinterpret_cast<const uint8_t*>(page.data()),
                       page.size() * sizeof(bf16), tokens, head_dim};
      PageSpan span{0, 0, rows};
      reference::PagedAttention(view, &span, rows > 0 ? 1 : 0, DecodeQuery{q.data(), group, scale},
                                AttentionState{out.data(), lse.data()});
      want_out.push_back(out);
      want_lse.push_back(lse);
      bf16* dpage = dev_.ToDevice(page);
      WindowProblem p;
      p.k = dpage;
      p.v = dpage + tokens * head_dim;
      p.row_stride = head_dim;
      p.rows = rows;
      p.q = dev_.ToDevice(q);
      outs.push_back(p.out = dev_.ToDevice(std::vector<float>(group * head_dim, NAN)));
      lses.push_back(p.lse = dev_.ToDevice(std::vector<float>(group, NAN)));
      problems.push_back(p);
    }
    ASSERT_CUDA_OK(WindowAttention(dev_.ToDevice(problems), problems.size(), group, head_dim,
                                   scale, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    for (size_t i = 0; i < problems.size(); ++i) {
      const std::vector<float> out = DeviceBuffers::ToHost(outs[i], group * head_dim);
      const std::vector<float> lse = DeviceBuffers::ToHost(lses[i], group);
      if (rows_per_problem[i] == 0) {
        for (float v : out) EXPECT_EQ(v, 0.0f);
        for (float v : lse) EXPECT_EQ(v, -INFINITY);
        continue;
      }
      EXPECT_LT(RelErr(out, want_out[i]), 1e-5) << "head_dim " << head_dim << " problem " << i;
      for (int64_t h = 0; h < group; ++h) {
        EXPECT_NEAR(lse[h], want_lse[i][h], 1e-4 * std::max(1.0f, std::fabs(want_lse[i][h])));
      }
    }
  }
  EXPECT_EQ(WindowAttention(nullptr, 1, 4, 96, 1.0f, nullptr), cudaErrorInvalidValue);
}

TEST_F(DecodeOpsTest, MergeStatesMatchesReferenceIncludingEmptySides) {
  const int64_t states = 6, head_dim = 128;
  std::vector<float> out_a = RandomNormal(states * head_dim, 20), out_b = RandomNormal(states * head_dim, 21);
  // Both full, a empty, b empty, both empty, large gap, equal.
  std::vector<float> lse_a = {1.5f, -INFINITY, 3.0f, -INFINITY, 80.0f, 2.0f};
  std::vector<float> lse_b = {0.5f, 2.0f, -INFINITY, -INFINITY, -5.0f, 2.0f};
  for (int64_t d = 0; d < head_dim; ++d) {  // an empty state's output is 0 by contract
    out_a[1 * head_dim + d] = out_a[3 * head_dim + d] = 0.0f;
    out_b[2 * head_dim + d] = out_b[3 * head_dim + d] = 0.0f;
  }
  std::vector<float> want_out = out_a, want_lse = lse_a;
  for (int64_t s = 0; s < states; ++s) {
    reference::MergeAttentionStates(want_out.data() + s * head_dim, want_lse.data() + s,
                                    out_b.data() + s * head_dim, lse_b.data() + s, 1, head_dim);
  }
  float* da = dev_.ToDevice(out_a);
  float* dla = dev_.ToDevice(lse_a);
  ASSERT_CUDA_OK(MergeStates(da, dla, dev_.ToDevice(out_b), dev_.ToDevice(lse_b), states,
                             head_dim, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LT(RelErr(DeviceBuffers::ToHost(da, out_a.size()), want_out), 1e-6);
  const std::vector<float> lse = DeviceBuffers::ToHost(dla, states);
  for (int64_t s = 0; s < states; ++s) {
    if (std::isinf(want_lse[s])) {
      EXPECT_EQ(lse[s], want_lse[s]) << s;
    } else {
      EXPECT_NEAR(lse[s], want_lse[s], 1e-5 * std::max(1.0f, std::fabs(want_lse[s]))) << s;
    }
  }
}

}  // namespace
}  // namespace fluxion::kernels::cuda
