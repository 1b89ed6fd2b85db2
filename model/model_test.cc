// The model against an independent, obviously-correct forward pass built from kernels/reference
// (no KV cache, whole sequence recomputed, double accumulation), plus the cache and error paths.
// Transformers itself is the oracle in tests/hf_reference_test.cc.
#include "model/model.h"

#include <cmath>
#include <filesystem>
#include <random>

#include <unistd.h>

#include "gtest/gtest.h"
#include "kernels/reference/reference_ops.h"
#include "model/cpu_dense_ops.h"
#include "model/generator.h"
#include "model/random_model.h"
#include "model/rope.h"

namespace fluxion::model {
namespace {

namespace ref = ::fluxion::kernels::reference;

// Both sides compute in fp32 from identical weights; the reference accumulates in double and
// evaluates RoPE angles in double. Differences are rounding: <= 2e-4 relative to the logit scale.
constexpr double kLogitTol = 2e-4;

// Unique per test and process: ctest runs the tests of this file as parallel processes.
std::string TempModelDir(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return ::testing::TempDir() + "/fluxion_model_test_" + name + "_" + info->name() + "_" +
         std::to_string(getpid());
}

// Last-position logits of `tokens` computed from scratch with the reference kernels.
std::vector<float> ReferenceLogits(const Model& model, const Checkpoint& ckpt,
                                   const std::vector<int32_t>& tokens) {
  const ModelConfig& c = model.config();
  const int64_t n = tokens.size(), h = c.hidden_size, d = c.head_dim, f = c.intermediate_size;
  auto w = [&](const std::string& name) {
    return ReadAsFloat(**ckpt.Find(name), (*ckpt.Find(name))->shape).value();
  };
  auto linear = [&](const std::string& name, const std::vector<float>& x, int64_t out, int64_t in,
                    bool bias, std::vector<float>* y, bool accumulate) {
    std::vector<float> weight = w(name + ".weight"), b;
    if (bias) b = w(name + ".bias");
    ref::MatMul(x.data(), weight.data(), bias ? b.data() : nullptr, y->data(), n, out, in,
                accumulate);
  };
  std::vector<float> embed = w("model.embed_tokens.weight");
  std::vector<float> x(n * h), normed(n * h), q(n * c.num_heads * d), k(n * c.num_kv_heads * d),
      v(n * c.num_kv_heads * d), attn(n * c.num_heads * d), gate(n * f), up(n * f);
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(embed.data() + tokens[i] * h, h, x.data() + i * h);
  }
  std::vector<int64_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = i;
  std::vector<float> inv_freq = ComputeInvFreq(c.rope, d);
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    ref::RmsNorm(x.data(), w(p + "input_layernorm.weight").data(), eps, normed.data(), n, h);
    linear(p + "self_attn.q_proj", normed, c.num_heads * d, h, c.qkv_bias, &q, false);
    linear(p + "self_attn.k_proj", normed, c.num_kv_heads * d, h, c.qkv_bias, &k, false);
    linear(p + "self_attn.v_proj", normed, c.num_kv_heads * d, h, c.qkv_bias, &v, false);
    ref::ApplyRope(q.data(), pos.data(), inv_freq.data(), n, c.num_heads, d);
    ref::ApplyRope(k.data(), pos.data(), inv_freq.data(), n, c.num_kv_heads, d);
    ref::CausalAttention(q.data(), k.data(), v.data(), attn.data(),
                         {n, 0, c.num_heads, c.num_kv_heads, d, 1.0f / std::sqrt(float(d))});
    linear(p + "self_attn.o_proj", attn, h, c.num_heads * d, c.o_bias, &x, true);
    ref::RmsNorm(x.data(), w(p + "post_attention_layernorm.weight").data(), eps, normed.data(), n,
                 h);
    linear(p + "mlp.gate_proj", normed, f, h, false, &gate, false);
    linear(p + "mlp.up_proj", normed, f, h, false, &up, false);
    ref::SiluMul(gate.data(), up.data(), gate.data(), n * f);
    linear(p + "mlp.down_proj", gate, h, f, false, &x, true);
  }
  std::vector<float> last(x.end() - h, x.end()), last_normed(h);
  ref::RmsNorm(last.data(), w("model.norm.weight").data(), eps, last_normed.data(), 1, h);
  std::vector<float> head = c.tie_word_embeddings ? embed : w("lm_head.weight");
  std::vector<float> logits(c.vocab_size);
  ref::MatMul(last_normed.data(), head.data(), nullptr, logits.data(), 1, c.vocab_size, h, false);
  return logits;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b, double* scale) {
  double diff = 0, s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    s = std::max(s, std::abs(double(b[i])));
  }
  *scale = std::max(1.0, s);
  return diff;
}

std::vector<int32_t> RandomTokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

class ModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ModelConfig c = PresetConfig("tiny").value();
    if (GetParam() == "qwen2") {
      c.architecture = Architecture::kQwen2;
      c.qkv_bias = true;
      c.tie_word_embeddings = true;
      c.num_kv_heads = 1;  // MQA
      c.rope = RopeConfig{RopeType::kDefault, 10000.0};
    }
    dir_ = TempModelDir(GetParam());
    ASSERT_TRUE(WriteRandomModel(c, 7, dir_).ok());
    auto model = Model::Load(dir_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    auto ckpt = Checkpoint::Open(dir_);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ckpt_ = std::move(*ckpt);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string dir_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Checkpoint> ckpt_;
};

TEST_P(ModelTest, PrefillLogitsMatchReferenceForward) {
  // 600 tokens: crosses the 512-token prefill chunk and several attention query tiles.
  for (int64_t n : {1, 37, 600}) {
    auto tokens = RandomTokens(n, model_->config().vocab_size, n);
    auto seq = model_->NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(model_->Forward(*seq, tokens, &logits).ok());
    EXPECT_EQ(seq->length(), n);
    double scale;
    double diff = MaxAbsDiff(logits, ReferenceLogits(*model_, *ckpt_, tokens), &scale);
    EXPECT_LE(diff, kLogitTol * scale) << "n=" << n;
  }
}

TEST_P(ModelTest, IncrementalDecodeMatchesOneShotPrefill) {
  auto tokens = RandomTokens(40, model_->config().vocab_size, 3);
  auto whole = model_->NewSequence();
  std::vector<float> all;
  ASSERT_TRUE(model_->Forward(*whole, tokens, &all, /*all_logits=*/true).ok());
  auto step = model_->NewSequence();
  std::vector<float> logits;
  const int64_t vocab = model_->config().vocab_size;
  ASSERT_TRUE(model_->Forward(*step, absl::MakeConstSpan(tokens).subspan(0, 25), &logits).ok());
  for (size_t i = 25; i < tokens.size(); ++i) {
    ASSERT_TRUE(model_->Forward(*step, absl::MakeConstSpan(&tokens[i], 1), &logits).ok());
    std::vector<float> want(all.begin() + i * vocab, all.begin() + (i + 1) * vocab);
    double scale;
    const double diff = MaxAbsDiff(logits, want, &scale);
    EXPECT_LE(diff, 1e-4 * scale) << "position " << i;
  }
}

TEST_P(ModelTest, TokenOutsideVocabularyIsInvalidArgument) {
  auto seq = model_->NewSequence();
  std::vector<float> logits;
  std::vector<int32_t> bad = {1, static_cast<int32_t>(model_->config().vocab_size)};
  absl::Status s = model_->Forward(*seq, bad, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("vocabulary"), std::string::npos);
  EXPECT_EQ(seq->length(), 0);
}

TEST_P(ModelTest, GreedyGenerationIsDeterministicAndRespectsMaxTokens) {
  GenerationOptions opts;
  opts.max_tokens = 12;
  opts.ignore_eos = true;
  auto prompt = RandomTokens(9, model_->config().vocab_size, 11);
  auto a = Generate(*model_, prompt, opts);
  auto b = Generate(*model_, prompt, opts);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens.size(), 12u);
  EXPECT_EQ(a->finish_reason, FinishReason::kLength);
  EXPECT_EQ(a->tokens, b->tokens);
}

TEST_P(ModelTest, GenerationStopsAtStopTokenAndIncludesIt) {
  GenerationOptions opts;
  opts.max_tokens = 12;
  opts.ignore_eos = true;
  auto prompt = RandomTokens(9, model_->config().vocab_size, 11);
  auto free_run = Generate(*model_, prompt, opts);
  ASSERT_TRUE(free_run.ok());
  opts.stop_token_ids = {free_run->tokens[3]};
  auto stopped = Generate(*model_, prompt, opts);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->finish_reason, FinishReason::kStop);
  // Stops at the first occurrence of the stop token, which may come before index 3.
  ASSERT_LE(stopped->tokens.size(), 4u);
  EXPECT_EQ(stopped->tokens.back(), free_run->tokens[3]);
}

// GenerationOptions::decode_ops (what `fluxion generate --device` sets): decode steps through the
// batched seam. With one row the step issues the calls Forward issues, so on the CPU ops the
// tokens are the same.
TEST_P(ModelTest, GenerationThroughTheDecodeStepSeamGivesForwardsTokens) {
  GenerationOptions opts;
  opts.max_tokens = 12;
  opts.ignore_eos = true;
  auto prompt = RandomTokens(9, model_->config().vocab_size, 11);
  auto forward = Generate(*model_, prompt, opts);
  CpuDenseOps ops;
  opts.decode_ops = &ops;
  auto seam = Generate(*model_, prompt, opts);
  ASSERT_TRUE(forward.ok() && seam.ok());
  EXPECT_EQ(seam->tokens, forward->tokens);
  EXPECT_EQ(seam->sequence->length(), forward->sequence->length());
}

INSTANTIATE_TEST_SUITE_P(Families, ModelTest, ::testing::Values("llama", "qwen2"));

TEST(ModelLoadTest, MissingTensorIsReportedByName) {
  const std::string dir = TempModelDir("missing");
  ModelConfig c = PresetConfig("tiny").value();
  ASSERT_TRUE(WriteRandomModel(c, 1, dir).ok());
  c.qkv_bias = true;  // the checkpoint has no biases
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  auto model = Model::FromCheckpoint(c, **ckpt);
  EXPECT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("model.layers.0.self_attn.q_proj.bias"),
            std::string::npos)
      << model.status();
  std::filesystem::remove_all(dir);
}

TEST(ModelLoadTest, ShapeMismatchIsReportedByName) {
  const std::string dir = TempModelDir("shape");
  ModelConfig c = PresetConfig("tiny").value();
  ASSERT_TRUE(WriteRandomModel(c, 1, dir).ok());
  c.intermediate_size += 8;
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  auto model = Model::FromCheckpoint(c, **ckpt);
  EXPECT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("model.layers.0.mlp.gate_proj.weight"),
            std::string::npos)
      << model.status();
  std::filesystem::remove_all(dir);
}

TEST(ModelLoadTest, TensorTheConfigDoesNotUseIsReportedByName) {
  const std::string dir = TempModelDir("unused");
  ModelConfig c = PresetConfig("tiny").value();
  c.qkv_bias = true;
  ASSERT_TRUE(WriteRandomModel(c, 1, dir).ok());
  c.qkv_bias = false;  // the checkpoint has biases the config ignores
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  auto model = Model::FromCheckpoint(c, **ckpt);
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(model.status().message().find("self_attn.k_proj.bias"), std::string::npos)
      << model.status();
  std::filesystem::remove_all(dir);
}

TEST(ModelLoadTest, MissingDirectoryIsNotFound) {
  auto model = Model::Load("/nonexistent/fluxion-model");
  EXPECT_EQ(model.status().code(), absl::StatusCode::kNotFound);
}

TEST(RopeTest, Llama3ScalingKeepsHighAndScalesLowFrequencies) {
  RopeConfig plain{RopeType::kDefault, 500000.0};
  RopeConfig scaled{RopeType::kLlama3, 500000.0, 8.0, 1.0, 4.0, 8192};
  auto a = ComputeInvFreq(plain, 128), b = ComputeInvFreq(scaled, 128);
  EXPECT_FLOAT_EQ(b[0], a[0]);             // wavelength 2*pi: untouched
  EXPECT_FLOAT_EQ(b[63], a[63] / 8.0f);    // longest wavelength: divided by factor
  bool saw_smoothed = false;
  for (int i = 0; i < 64; ++i) {
    if (b[i] < a[i] && b[i] > a[i] / 8.0f * 1.0001f) saw_smoothed = true;
  }
  EXPECT_TRUE(saw_smoothed);
}

}  // namespace
}  // namespace fluxion::model
