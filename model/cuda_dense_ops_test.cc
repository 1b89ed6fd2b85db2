// The CUDA DenseOps (cuda_dense_ops.h): each operation against the CPU ops or kernels/reference,
// then a whole batched decode step (DecodeStepRunner, attention on the host through
// SequenceBatchAttention) on CUDA against the same step on the CPU. The CUDA tests skip without a
// device; the factory's error is checked only without one; the whole-step tests also run (in CI)
// on a CPU emulation of the CUDA backend's rounding (Bf16InputCpuOps), which checks the tolerance.
//
// Tolerance of the whole step. The random models' weights are bf16 in the checkpoint, so the CPU
// model (fp32 copies of them) and the GPU (bf16 in HBM) multiply the same weights exactly: the CPU
// run IS the bf16-weight model in fp32. What differs is that the GPU rounds every GEMM input to
// bf16 (relative error <= 2^-9 per element, RMS 2^-9/sqrt(3) ~ 1.1e-3): 4 distinct inputs per layer
// (normed for q/k/v, attn for o, normed for gate/up, silu*up for down) x 4 layers + the LM head's
// = 17 roundings. Independent errors add in quadrature, ~sqrt(17) x 1.1e-3 ~ 5e-3 relative to the
// RMS logit. We compare max |gpu - cpu| / max(1, max |cpu|) per request and step against 2e-2
// (~3.5x what the CPU emulation of that rounding below measures: 5.7e-3 llama, 2.5e-3 qwen2);
// cached K/V likewise. Greedy tokens: both runs are fed the CPU's token each step (so one near-tie
// does not fork the sequences), and the GPU's argmax must equal the CPU's unless the CPU's top-2
// margin is within twice that row's largest difference (a bf16 near-tie: counted and printed; the
// emulation meets one in 64 argmaxes for llama, none for qwen2).
#include "model/cuda_dense_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include "common/half.h"
#include "common/random_testing.h"
#include "gtest/gtest.h"
#include "kernels/reference/reference_ops.h"
#include "model/cpu_dense_ops.h"
#include "model/decode_step.h"
#include "model/dense_attention.h"
#include "model/generator.h"
#include "model/model.h"
#include "model/random_model.h"

namespace fluxion::model {
namespace {

constexpr double kStepTol = 2e-2;

double RelDiff(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 1;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / scale;
}

TEST(CudaDenseOpsFactoryTest, WithoutADeviceItIsAFailedPreconditionNamingTheCpuFallback) {
  auto ops = NewCudaDenseOps(0);
  if (ops.ok()) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_EQ(ops.status().code(), absl::StatusCode::kFailedPrecondition) << ops.status();
  EXPECT_NE(ops.status().message().find("--device cpu"), std::string::npos) << ops.status();
}

class CudaDenseOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ops = NewCudaDenseOps(0);
    if (!ops.ok()) GTEST_SKIP() << ops.status();
    ops_ = std::move(*ops);
  }

  template <typename T>
  T* ToDevice(const std::vector<T>& host) {
    auto b = ops_->Allocate(host.size() * sizeof(T));
    EXPECT_TRUE(b.ok()) << b.status();
    ops_->CopyFromHost((*b)->data(), host.data(), host.size() * sizeof(T));
    T* p = static_cast<T*>((*b)->data());
    buffers_.push_back(std::move(*b));
    return p;
  }
  template <typename T>
  std::vector<T> ToHost(const T* d, size_t n) {
    std::vector<T> h(n);
    ops_->CopyToHost(h.data(), d, n * sizeof(T));
    return h;
  }
  WeightRef Upload(const std::vector<float>& host, int64_t rows, int64_t cols) {
    auto w = ops_->UploadWeight(host.data(), rows, cols);
    EXPECT_TRUE(w.ok()) << w.status();
    buffers_.push_back(std::move(w->owner));
    return w->ref;
  }

  std::unique_ptr<DenseOps> ops_;
  std::vector<std::unique_ptr<OpsBuffer>> buffers_;
};

// The product of bf16(x) and the bf16 weights accumulated in fp32, as the reference computes it
// from the same rounded operands; the bias and the residual (accumulate) added after.
TEST_F(CudaDenseOpsTest, MatMulIsTheBf16ProductWithBiasAndAccumulate) {
  const int64_t m = 5, n = 300, k = 896;
  const std::vector<float> x = RandomNormal(m * k, 1), w = RoundedToBf16(RandomNormal(n * k, 2, 0.05f));
  const std::vector<float> bias = RandomNormal(n, 3), y0 = RandomNormal(m * n, 4);
  const WeightRef dw = Upload(w, n, k);
  EXPECT_EQ(dw.dtype, WeightDType::kBF16);
  const float* dx = ToDevice(x);
  float* plain = ToDevice(std::vector<float>(m * n, NAN));
  float* acc = ToDevice(y0);
  ops_->MatMul(dx, dw, ToDevice(bias), plain, m, n, k, false);
  ops_->MatMul(dx, dw, nullptr, acc, m, n, k, true);
  ASSERT_TRUE(ops_->Sync().ok());
  const std::vector<float> xb = RoundedToBf16(x);
  std::vector<float> want_plain(m * n), want_acc = y0;
  kernels::reference::MatMul(xb.data(), w.data(), bias.data(), want_plain.data(), m, n, k, false);
  kernels::reference::MatMul(xb.data(), w.data(), nullptr, want_acc.data(), m, n, k, true);
  EXPECT_LE(RelDiff(ToHost(plain, m * n).data(), want_plain.data(), m * n), 1e-5);
  EXPECT_LE(RelDiff(ToHost(acc, m * n).data(), want_acc.data(), m * n), 1e-5);
}

// UploadWeight's chunked staging (16M floats a chunk) and GatherRows over the bf16 table: rows
// come back as the bf16 rounding of the host table, exactly, past the first chunk too.
TEST_F(CudaDenseOpsTest, UploadWeightRoundsToBf16AcrossChunksAndGatherRowsReadsIt) {
  const int64_t vocab = 4200, width = 4096;  // 17.2M floats: two staging chunks
  const std::vector<float> table = RandomNormal(vocab * width, 5);
  const WeightRef dt = Upload(table, vocab, width);
  const std::vector<int32_t> ids = {0, 4199, 4096, 17, 4199};
  float* out = ToDevice(std::vector<float>(ids.size() * width, NAN));
  ops_->GatherRows(dt, ToDevice(ids), ids.size(), width, out);
  const std::vector<float> got = ToHost(out, ids.size() * width);
  ASSERT_TRUE(ops_->Sync().ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t j = 0; j < width; ++j) {
      ASSERT_EQ(got[i * width + j], RoundToBf16(table[ids[i] * width + j])) << i << " " << j;
    }
  }
}

// The elementwise ops against the CPU backend on the same inputs; RoPE against the reference,
// whose angle is computed in double as the CUDA kernel's is (the CPU backend rounds the angle to
// fp32 as transformers does, ~4e-3 rad apart at position 131071; docs/GPU.md).
TEST_F(CudaDenseOpsTest, NormRopeSiluMatchTheCpuOps) {
  CpuDenseOps cpu;
  const int64_t m = 6, d = 896, heads = 14, head_dim = 64, f = 4864;
  const std::vector<float> x = RandomNormal(m * d, 6), g = RandomNormal(d, 7), gate = RandomNormal(m * f, 8),
                           up = RandomNormal(m * f, 9), q = RandomNormal(m * heads * head_dim, 10);
  const std::vector<int64_t> positions = {0, 1, 100, 4097, 32768, 131071};
  std::vector<float> inv_freq(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) inv_freq[i] = std::pow(1e6, -2.0 * i / head_dim);

  std::vector<float> want_norm(m * d), want_silu(m * f), want_q = q;
  cpu.RmsNorm(x.data(), g.data(), 1e-6f, want_norm.data(), m, d);
  cpu.SiluMul(gate.data(), up.data(), want_silu.data(), m * f);
  kernels::reference::ApplyRope(want_q.data(), positions.data(), inv_freq.data(), m, heads,
                                head_dim);

  float* dx = ToDevice(x);
  ops_->RmsNorm(dx, ToDevice(g), 1e-6f, dx, m, d);  // in place, as the contract allows
  float* dgate = ToDevice(gate);
  ops_->SiluMul(dgate, ToDevice(up), dgate, m * f);
  float* dq = ToDevice(q);
  ops_->ApplyRope(dq, ToDevice(positions), ToDevice(inv_freq), m, heads, head_dim);
  ASSERT_TRUE(ops_->Sync().ok());
  EXPECT_LE(RelDiff(ToHost(dx, m * d).data(), want_norm.data(), m * d), 1e-5);
  EXPECT_LE(RelDiff(ToHost(dgate, m * f).data(), want_silu.data(), m * f), 1e-5);
  EXPECT_LE(RelDiff(ToHost(dq, q.size()).data(), want_q.data(), q.size()), 1e-5);
}

// The fused operations (FusedDenseOps) against the plain ones on the same device and inputs: the
// q/k/v half (RMSNorm to bf16, one product over the stacked q/k/v rows, split + bias + RoPE) and
// the MLP half (RMSNorm to bf16, one gate/up product, SiLU * up to bf16, down with the residual).
// Both round the same fp32 values to bf16 before each product, so only the products' blocking
// differs (cuBLAS may choose another algorithm for the stacked shape): 1e-5 of the largest value
// for q/k/v; the MLP's bf16 rounding of silu * up can flip on such a difference, one bf16 ulp
// (2^-8) on a few down inputs: 1e-3.
TEST_F(CudaDenseOpsTest, FusedOpsMatchThePlainOps) {
  FusedDenseOps* fused = ops_->fused();
  ASSERT_NE(fused, nullptr);
  const int64_t m = 5, h = 512, heads = 8, kv = 2, hd = 64, f = 1024;
  const int64_t qw = heads * hd, kw = kv * hd, all = qw + 2 * kw;
  const std::vector<float> x = RandomNormal(m * h, 11), norm = RandomNormal(h, 12);
  const std::vector<float> wqkv = RoundedToBf16(RandomNormal(all * h, 13, 0.05f)),
                           bias = RandomNormal(all, 14);
  const std::vector<float> wgu = RoundedToBf16(RandomNormal(2 * f * h, 15, 0.05f)),
                           wdown = RoundedToBf16(RandomNormal(h * f, 16, 0.03f));
  const std::vector<int64_t> positions = {0, 5, 77, 4097, 131071};
  std::vector<float> inv_freq(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(5e5, -2.0 * i / hd);
  auto rows = [&](const std::vector<float>& w, int64_t first, int64_t n) {
    return std::vector<float>(w.begin() + first * h, w.begin() + (first + n) * h);
  };
  auto part = [&](const std::vector<float>& v, int64_t first, int64_t n) {
    return std::vector<float>(v.begin() + first, v.begin() + first + n);
  };
  const float* dx = ToDevice(x);
  const float* dnorm = ToDevice(norm);
  const int64_t* dpos = ToDevice(positions);
  const float* dfreq = ToDevice(inv_freq);

  // Plain: the layer body's unfused calls.
  float* normed = ToDevice(std::vector<float>(m * h, NAN));
  float* q = ToDevice(std::vector<float>(m * qw, NAN));
  float* k = ToDevice(std::vector<float>(m * kw, NAN));
  float* v = ToDevice(std::vector<float>(m * kw, NAN));
  ops_->RmsNorm(dx, dnorm, 1e-5f, normed, m, h);
  ops_->MatMul(normed, Upload(rows(wqkv, 0, qw), qw, h), ToDevice(part(bias, 0, qw)), q, m, qw, h,
               false);
  ops_->MatMul(normed, Upload(rows(wqkv, qw, kw), kw, h), ToDevice(part(bias, qw, kw)), k, m, kw,
               h, false);
  ops_->MatMul(normed, Upload(rows(wqkv, qw + kw, kw), kw, h), ToDevice(part(bias, qw + kw, kw)),
               v, m, kw, h, false);
  ops_->ApplyRope(q, dpos, dfreq, m, heads, hd);
  ops_->ApplyRope(k, dpos, dfreq, m, kv, hd);
  float* gate = ToDevice(std::vector<float>(m * f, NAN));
  float* up = ToDevice(std::vector<float>(m * f, NAN));
  float* y = ToDevice(x);
  ops_->MatMul(normed, Upload(rows(wgu, 0, f), f, h), nullptr, gate, m, f, h, false);
  ops_->MatMul(normed, Upload(rows(wgu, f, f), f, h), nullptr, up, m, f, h, false);
  ops_->SiluMul(gate, up, gate, m * f);
  const WeightRef down = Upload(wdown, h, f);
  ops_->MatMul(gate, down, nullptr, y, m, h, f, true);

  // Fused.
  auto scratch = ops_->Allocate(fused->GemmInputBytes(m * f));
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  void* xg = (*scratch)->data();
  float* qkv = ToDevice(std::vector<float>(m * all, NAN));
  float* fq = ToDevice(std::vector<float>(m * qw, NAN));
  float* fk = ToDevice(std::vector<float>(m * kw, NAN));
  float* fv = ToDevice(std::vector<float>(m * kw, NAN));
  fused->RmsNormToGemmInput(dx, dnorm, 1e-5f, xg, m, h);
  fused->MatMulGemmInput(xg, Upload(wqkv, all, h), nullptr, qkv, m, all, h, false);
  fused->SplitQkvRope(qkv, ToDevice(bias), dpos, dfreq, fq, fk, fv, m, heads, kv, hd);
  float* gu = ToDevice(std::vector<float>(m * 2 * f, NAN));
  float* fy = ToDevice(x);
  fused->MatMulGemmInput(xg, Upload(wgu, 2 * f, h), nullptr, gu, m, 2 * f, h, false);
  fused->SiluMulToGemmInput(gu, xg, m, f);
  fused->MatMulGemmInput(xg, down, nullptr, fy, m, h, f, true);
  ASSERT_TRUE(ops_->Sync().ok());

  for (auto [got, want, n, tol] :
       {std::tuple{fq, q, m * qw, 1e-5}, std::tuple{fk, k, m * kw, 1e-5},
        std::tuple{fv, v, m * kw, 1e-5}, std::tuple{fy, y, m * h, 1e-3}}) {
    const std::vector<float> g = ToHost(got, n), w = ToHost(want, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_FALSE(std::isnan(g[i])) << i;  // every value written
    EXPECT_LE(RelDiff(g.data(), w.data(), n), tol);
  }
}

// Small copies from the host are staged (pinned) and return before they run: the caller's buffer
// is reused at once, many times past the staging's 1 MiB (so it wraps), and every destination
// still holds what was copied at its call.
TEST_F(CudaDenseOpsTest, SmallCopiesFromTheHostMayReuseTheSourceAtOnce) {
  const int64_t copies = 100, n = 4000;  // 16 KB each, 1.6 MB in all
  auto dst = ops_->Allocate(copies * n * sizeof(int32_t));
  ASSERT_TRUE(dst.ok()) << dst.status();
  int32_t* d = static_cast<int32_t*>((*dst)->data());
  std::vector<int32_t> src(n);
  for (int64_t c = 0; c < copies; ++c) {
    for (int64_t i = 0; i < n; ++i) src[i] = static_cast<int32_t>(c * n + i);
    ops_->CopyFromHost(d + c * n, src.data(), n * sizeof(int32_t));
  }
  std::fill(src.begin(), src.end(), -1);
  const std::vector<int32_t> got = ToHost(d, copies * n);
  ASSERT_TRUE(ops_->Sync().ok());
  for (int64_t i = 0; i < copies * n; ++i) ASSERT_EQ(got[i], i) << i;
}

// Copy is memmove: overlapping moves in both directions (a batch compaction moves rows down).
TEST_F(CudaDenseOpsTest, CopyHandlesOverlappingRanges) {
  std::vector<int32_t> v(1000);
  for (int i = 0; i < 1000; ++i) v[i] = i;
  int32_t* d = ToDevice(v);
  ops_->Copy(d, d + 100, 800 * sizeof(int32_t));  // down
  std::vector<int32_t> want = v;
  std::memmove(want.data(), want.data() + 100, 800 * sizeof(int32_t));
  EXPECT_EQ(ToHost(d, 1000), want);
  ops_->Copy(d + 50, d, 900 * sizeof(int32_t));  // up
  std::memmove(want.data() + 50, want.data(), 900 * sizeof(int32_t));
  EXPECT_EQ(ToHost(d, 1000), want);
  EXPECT_TRUE(ops_->Sync().ok());
}

// The sampler's candidates on the device equal the CPU ops' host computation of them: ids and
// logits exactly (both are the exact top-k in the sampler's order), normalisers to double
// rounding (summed in another order). Two calls with different row counts exercise the scratch.
TEST_F(CudaDenseOpsTest, TopCandidatesMatchTheCpuOps) {
  ASSERT_NE(ops_->candidates(), nullptr);
  CpuDenseOps cpu;
  for (const auto& [rows, vocab, k] :
       {std::tuple<int64_t, int64_t, int64_t>{3, 5001, 40}, {16, 128256, 1024}, {2, 700, 1024}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(vocab) + " k " + std::to_string(k));
    std::vector<float> x = RandomNormal(rows * vocab, static_cast<uint32_t>(vocab), 3.0f);
    for (size_t i = 0; i < x.size(); i += 7) x[i] = std::round(x[i]);  // ties
    std::vector<double> temps(rows);
    for (int64_t r = 0; r < rows; ++r) temps[r] = r % 2 ? 0.0 : 0.7;
    const int64_t n = std::min(k, vocab);
    std::vector<int32_t> ids(rows * n), want_ids(rows * n);
    std::vector<float> values(rows * n), want_values(rows * n);
    std::vector<double> norms(rows), want_norms(rows);
    ops_->candidates()->TopCandidates(ToDevice(x), rows, vocab, k, temps.data(), ids.data(),
                                      values.data(), norms.data());
    ASSERT_TRUE(ops_->Sync().ok());
    cpu.TopCandidates(x.data(), rows, vocab, k, temps.data(), want_ids.data(), want_values.data(),
                      want_norms.data());
    EXPECT_EQ(ids, want_ids);
    EXPECT_EQ(values, want_values);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_NEAR(norms[r], want_norms[r], 1e-10 * std::max(1.0, want_norms[r])) << "row " << r;
    }
  }
}

// Errors: an allocation too large is ResourceExhausted at once; a failed operation is recorded
// and returned by the next Sync (once: the Sync after it is OK again).
TEST_F(CudaDenseOpsTest, ErrorsAreReturnedBySyncOnce) {
  auto huge = ops_->Allocate(size_t{1} << 50);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  const std::vector<float> host_w(16, 1.0f);
  float* y = ToDevice(std::vector<float>(4));
  const float* x = ToDevice(std::vector<float>(4, 1.0f));
  ops_->MatMul(x, WeightRef{host_w.data(), WeightDType::kF32}, nullptr, y, 1, 4, 4, false);
  const absl::Status s = ops_->Sync();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("did not upload"), std::string::npos) << s;
  EXPECT_TRUE(ops_->Sync().ok());
}

// The CPU ops with the CUDA backend's rounding: every GEMM input rounded to bf16 first (the
// weights of the random models already are bf16). The whole-step tests run on it too, so CI
// checks the tolerance derivation in the header against the rounding it models, without a GPU.
class Bf16InputCpuOps : public CpuDenseOps {
 public:
  absl::string_view name() const override { return "cpu-bf16-inputs"; }
  void MatMul(const float* x, WeightRef w, const float* bias, float* y, int64_t m, int64_t n,
              int64_t k, bool accumulate) override {
    rounded_.assign(x, x + m * k);
    for (float& v : rounded_) v = RoundToBf16(v);
    CpuDenseOps::MatMul(rounded_.data(), w, bias, y, m, n, k, accumulate);
  }

 private:
  std::vector<float> rounded_;
};

// A whole decode step on CUDA (or its CPU emulation) vs the CPU: see the header for the tolerance.
// Parameter: "<family>/<backend>", backend cuda or emulation.
class CudaDecodeStepTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string param = GetParam();
    const std::string family = param.substr(0, param.find('_'));
    if (param.find("_cuda") != std::string::npos) {
      auto ops = NewCudaDenseOps(0);
      if (!ops.ok()) GTEST_SKIP() << ops.status();
      gpu_ = std::move(*ops);
    } else {
      gpu_ = std::make_unique<Bf16InputCpuOps>();
    }
    ModelConfig c = PresetConfig("tiny").value();  // Llama: llama3 RoPE scaling, GQA 8:2
    if (family == "qwen2") {  // q/k/v bias, tied embeddings, GQA 8:1, default RoPE
      c.architecture = Architecture::kQwen2;
      c.qkv_bias = true;
      c.tie_word_embeddings = true;
      c.num_kv_heads = 1;
      c.rope = RopeConfig{RopeType::kDefault, 1000000.0};
    }
    dir_ = ::testing::TempDir() + "/fluxion_cuda_decode_step_" + GetParam() + "_" +
           std::to_string(getpid());
    ASSERT_TRUE(WriteRandomModel(c, 23, dir_).ok());
    auto model = Model::Load(dir_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  std::unique_ptr<DenseOps> gpu_;
  std::string dir_;
  std::unique_ptr<Model> model_;
};

int32_t Argmax(const float* logits, int64_t vocab) {
  return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
}

// The gap between the largest and the second largest logit.
double TopTwoMargin(const float* logits, int64_t vocab) {
  std::vector<float> v(logits, logits + vocab);
  std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
  return double(v[0]) - v[1];
}

TEST_P(CudaDecodeStepTest, SixteenStepsOfFourRequestsMatchTheCpu) {
  const ModelConfig& c = model_->config();
  const int64_t vocab = c.vocab_size;
  const std::vector<int64_t> prompt_lengths = {3, 17, 64, 9};  // rows at different positions
  const int64_t b = prompt_lengths.size();
  std::vector<std::unique_ptr<Sequence>> on_gpu, on_cpu;
  std::vector<int32_t> next(b);
  std::vector<float> logits;
  for (int64_t i = 0; i < b; ++i) {
    std::mt19937 rng(100 + i);
    std::vector<int32_t> prompt(prompt_lengths[i]);
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % vocab);
    on_gpu.push_back(model_->NewSequence());
    on_cpu.push_back(model_->NewSequence());
    ASSERT_TRUE(model_->Forward(*on_gpu[i], prompt, &logits).ok());  // prefill on the CPU
    ASSERT_TRUE(model_->Forward(*on_cpu[i], prompt, &logits).ok());
    next[i] = Argmax(logits.data(), vocab);
  }
  std::vector<Sequence*> gpu_seqs, cpu_seqs;
  for (int64_t i = 0; i < b; ++i) {
    gpu_seqs.push_back(on_gpu[i].get());
    cpu_seqs.push_back(on_cpu[i].get());
  }
  CpuDenseOps cpu;
  auto gpu_runner = DecodeStepRunner::Create(*model_, gpu_.get());
  ASSERT_TRUE(gpu_runner.ok()) << gpu_runner.status();
  auto cpu_runner = DecodeStepRunner::Create(*model_, &cpu);
  ASSERT_TRUE(cpu_runner.ok()) << cpu_runner.status();
  SequenceBatchAttention gpu_attention(gpu_seqs, model_->attention_shape(), gpu_.get());
  SequenceBatchAttention cpu_attention(cpu_seqs, model_->attention_shape(), &cpu);

  std::vector<float> gpu_logits(b * vocab), cpu_logits(b * vocab);
  double worst = 0;
  int near_ties = 0;
  for (int step = 0; step < 16; ++step) {
    std::vector<int64_t> positions;
    for (int64_t i = 0; i < b; ++i) positions.push_back(on_cpu[i]->length());
    absl::Status s = (*gpu_runner)->Step(next, positions, gpu_attention, gpu_logits.data());
    ASSERT_TRUE(s.ok()) << s;
    s = (*cpu_runner)->Step(next, positions, cpu_attention, cpu_logits.data());
    ASSERT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < b; ++i) {
      const float* g = gpu_logits.data() + i * vocab;
      const float* want = cpu_logits.data() + i * vocab;
      const double diff = RelDiff(g, want, vocab);
      worst = std::max(worst, diff);
      EXPECT_LE(diff, kStepTol) << "request " << i << " step " << step;
      // A flip is excused only where this row's own error could cause it: the CPU's top-2 margin
      // within twice the largest difference of the row.
      double row_diff = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        row_diff = std::max(row_diff, std::abs(double(g[v]) - want[v]));
      }
      if (Argmax(g, vocab) != Argmax(want, vocab)) {
        EXPECT_LE(TopTwoMargin(want, vocab), 2 * row_diff) << "request " << i << " step " << step;
        ++near_ties;
      }
      next[i] = Argmax(want, vocab);
    }
  }
  const int64_t row = c.num_kv_heads * c.head_dim;
  for (int64_t i = 0; i < b; ++i) {
    ASSERT_EQ(on_gpu[i]->length(), prompt_lengths[i] + 16);
    const auto& got = static_cast<const DenseAttention&>(on_gpu[i]->attention());
    const auto& want = static_cast<const DenseAttention&>(on_cpu[i]->attention());
    for (int l = 0; l < c.num_layers; ++l) {
      ASSERT_EQ(got.length(l), want.length(l));
      EXPECT_LE(RelDiff(got.keys(l), want.keys(l), got.length(l) * row), kStepTol);
      EXPECT_LE(RelDiff(got.values(l), want.values(l), got.length(l) * row), kStepTol);
    }
  }
  std::cout << GetParam() << ": worst logits difference " << worst << " of the largest logit"
            << " (tolerance " << kStepTol << "), " << near_ties << " near-tie argmaxes\n";
}

// What `fluxion generate --device cuda` runs: greedy generation with the decode steps' dense half
// on the GPU gives the CPU's tokens (free-running, so a bf16 near-tie would fork the sequences:
// the teacher-forced test above is the one that tells a near-tie from a divergence).
TEST_P(CudaDecodeStepTest, GreedyGenerationOnTheGpuGivesTheCpuTokens) {
  GenerationOptions opts;
  opts.max_tokens = 16;
  opts.ignore_eos = true;
  std::mt19937 rng(7);
  std::vector<int32_t> prompt(21);
  for (auto& t : prompt) t = static_cast<int32_t>(rng() % model_->config().vocab_size);
  auto cpu = Generate(*model_, prompt, opts);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  opts.decode_ops = gpu_.get();
  auto gpu = Generate(*model_, prompt, opts);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ(gpu->tokens, cpu->tokens);
}

// The step with CUDA graphs (the default where the ops offer them: dense segments recorded at the
// second step of a batch size, replayed after) gives the eager step's logits bit for bit, and the
// graphs did run. Two runners over the same ops and model, one with graphs off; attention on the
// host between the segments.
TEST_P(CudaDecodeStepTest, StepsWithGraphsEqualStepsWithout) {
  const ModelConfig& c = model_->config();
  const int64_t vocab = c.vocab_size, b = 3;
  std::vector<std::unique_ptr<Sequence>> eager_seqs, graph_seqs;
  std::vector<float> scratch;
  for (int64_t i = 0; i < b; ++i) {
    std::vector<int32_t> prompt(5 + 7 * i, static_cast<int32_t>(11 * i + 2));
    for (auto* seqs : {&eager_seqs, &graph_seqs}) {
      seqs->push_back(model_->NewSequence());
      ASSERT_TRUE(model_->Forward(*seqs->back(), prompt, &scratch).ok());
    }
  }
  auto eager = DecodeStepRunner::Create(*model_, gpu_.get());
  ASSERT_TRUE(eager.ok()) << eager.status();
  (*eager)->set_use_graphs(false);
  auto graphed = DecodeStepRunner::Create(*model_, gpu_.get());
  ASSERT_TRUE(graphed.ok()) << graphed.status();
  std::vector<Sequence*> ep, gp;
  for (int64_t i = 0; i < b; ++i) {
    ep.push_back(eager_seqs[i].get());
    gp.push_back(graph_seqs[i].get());
  }
  SequenceBatchAttention eager_attention(ep, model_->attention_shape(), gpu_.get());
  SequenceBatchAttention graph_attention(gp, model_->attention_shape(), gpu_.get());
  std::vector<float> want(b * vocab), got(b * vocab);
  for (int step = 0; step < 5; ++step) {
    std::vector<int32_t> tokens;
    std::vector<int64_t> positions;
    for (int64_t i = 0; i < b; ++i) {
      tokens.push_back(static_cast<int32_t>((13 * step + 5 * i) % vocab));
      positions.push_back(eager_seqs[i]->length());
    }
    absl::Status s = (*eager)->Step(tokens, positions, eager_attention, want.data());
    ASSERT_TRUE(s.ok()) << s;
    s = (*graphed)->Step(tokens, positions, graph_attention, got.data());
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
        << "step " << step;
  }
  EXPECT_TRUE((*graphed)->graph_status().ok()) << (*graphed)->graph_status();
  if (gpu_->graphs() != nullptr) {
    // Steps 1 (recorded and replayed) to 4 (replayed): num_layers + 1 segments each.
    EXPECT_EQ((*graphed)->graph_replays(), 4 * (c.num_layers + 1));
  }
  EXPECT_EQ((*eager)->graph_replays(), 0);
}

INSTANTIATE_TEST_SUITE_P(Families, CudaDecodeStepTest,
                         ::testing::Values("llama_cuda", "qwen2_cuda", "llama_emulation",
                                           "qwen2_emulation"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace fluxion::model
