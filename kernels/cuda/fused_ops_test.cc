// The fused dense-step kernels (RmsNormBf16, SiluMulRowsBf16, SplitQkvRope) against the unfused
// kernels they replace, on the same device and inputs: bit for bit, since they compute the same
// fp32 (and double, for RoPE) expressions and round the same values.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/random_testing.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/decode_ops.h"
#include "kernels/cuda/device_buffers_testing.h"

namespace fluxion::kernels::cuda {
namespace {

template <typename T>
void ExpectSameBits(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0) << what << " element " << i;
  }
}

TEST(FusedOpsTest, NormAndSiluToBf16EqualTheFp32KernelsThenTheCast) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffers dev;
  const int64_t m = 7, d = 4096, f = 1000;
  const float* x = dev.ToDevice(RandomNormal(m * d, 1));
  const float* w = dev.ToDevice(RandomNormal(d, 2));
  float* y = dev.ToDevice(std::vector<float>(m * d));
  bf16* want = dev.ToDevice(std::vector<bf16>(m * d));
  bf16* got = dev.ToDevice(std::vector<bf16>(m * d));
  ASSERT_EQ(RmsNorm(x, w, 1e-5f, y, m, d, nullptr), cudaSuccess);
  ASSERT_EQ(CastToBf16(y, want, m * d, nullptr), cudaSuccess);
  ASSERT_EQ(RmsNormBf16(x, w, 1e-5f, got, m, d, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectSameBits(DeviceBuffers::ToHost(got, m * d), DeviceBuffers::ToHost(want, m * d), "norm");

  const std::vector<float> gu = RandomNormal(m * 2 * f, 3);
  std::vector<float> gate(m * f), up(m * f);
  for (int64_t t = 0; t < m; ++t) {
    std::memcpy(&gate[t * f], &gu[t * 2 * f], f * sizeof(float));
    std::memcpy(&up[t * f], &gu[t * 2 * f + f], f * sizeof(float));
  }
  float* dgate = dev.ToDevice(gate);
  bf16* silu_want = dev.ToDevice(std::vector<bf16>(m * f));
  bf16* silu_got = dev.ToDevice(std::vector<bf16>(m * f));
  ASSERT_EQ(SiluMul(dgate, dev.ToDevice(up), dgate, m * f, nullptr), cudaSuccess);
  ASSERT_EQ(CastToBf16(dgate, silu_want, m * f, nullptr), cudaSuccess);
  ASSERT_EQ(SiluMulRowsBf16(dev.ToDevice(gu), silu_got, m, f, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectSameBits(DeviceBuffers::ToHost(silu_got, m * f), DeviceBuffers::ToHost(silu_want, m * f),
                 "silu");
}

TEST(FusedOpsTest, SplitQkvRopeEqualsBiasAddsAndRopeOnTheSeparateProducts) {
  if (!DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffers dev;
  const int64_t m = 5, heads = 32, kv = 8, hd = 128, qw = heads * hd, kw = kv * hd;
  const int64_t all = qw + 2 * kw;
  const std::vector<float> qkv = RandomNormal(m * all, 4), bias = RandomNormal(all, 5);
  const std::vector<int64_t> positions = {0, 1, 999, 32768, 131071};
  std::vector<float> inv_freq(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(5e5f, -2.0f * i / hd);
  // The separate products' outputs, as the unfused path has them.
  std::vector<float> q(m * qw), k(m * kw), v(m * kw);
  for (int64_t t = 0; t < m; ++t) {
    std::memcpy(&q[t * qw], &qkv[t * all], qw * sizeof(float));
    std::memcpy(&k[t * kw], &qkv[t * all + qw], kw * sizeof(float));
    std::memcpy(&v[t * kw], &qkv[t * all + qw + kw], kw * sizeof(float));
  }
  const int64_t* dpos = dev.ToDevice(positions);
  const float* dfreq = dev.ToDevice(inv_freq);
  float *dq = dev.ToDevice(q), *dk = dev.ToDevice(k), *dv = dev.ToDevice(v);
  const std::vector<float> bq(bias.begin(), bias.begin() + qw),
      bk(bias.begin() + qw, bias.begin() + qw + kw), bv(bias.begin() + qw + kw, bias.end());
  ASSERT_EQ(AddBiasRows(dq, dev.ToDevice(bq), m, qw, nullptr), cudaSuccess);
  ASSERT_EQ(AddBiasRows(dk, dev.ToDevice(bk), m, kw, nullptr), cudaSuccess);
  ASSERT_EQ(AddBiasRows(dv, dev.ToDevice(bv), m, kw, nullptr), cudaSuccess);
  ASSERT_EQ(ApplyRope(dq, dpos, dfreq, m, heads, hd, nullptr), cudaSuccess);
  ASSERT_EQ(ApplyRope(dk, dpos, dfreq, m, kv, hd, nullptr), cudaSuccess);
  const float nan = std::nanf("");
  float* fq = dev.ToDevice(std::vector<float>(m * qw, nan));
  float* fk = dev.ToDevice(std::vector<float>(m * kw, nan));
  float* fv = dev.ToDevice(std::vector<float>(m * kw, nan));
  for (const bool with_bias : {true, false}) {
    ASSERT_EQ(SplitQkvRope(dev.ToDevice(qkv), with_bias ? dev.ToDevice(bias) : nullptr, dpos,
                           dfreq, fq, fk, fv, m, heads, kv, hd, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (!with_bias) {
      // Without a bias, v is the product's slice as it is.
      ExpectSameBits(DeviceBuffers::ToHost(fv, m * kw), v, "v (no bias)");
      break;
    }
    ExpectSameBits(DeviceBuffers::ToHost(fq, m * qw), DeviceBuffers::ToHost(dq, m * qw), "q");
    ExpectSameBits(DeviceBuffers::ToHost(fk, m * kw), DeviceBuffers::ToHost(dk, m * kw), "k");
    ExpectSameBits(DeviceBuffers::ToHost(fv, m * kw), DeviceBuffers::ToHost(dv, m * kw), "v");
  }
}

}  // namespace
}  // namespace fluxion::kernels::cuda
