// Our CPU model runtime against Hugging Face transformers itself.
//
// tests/data/hf/<model>/ holds tiny random checkpoints saved by transformers' own
// LlamaForCausalLM / Qwen2ForCausalLM with save_pretrained, plus what transformers computed on them
// (reference.json): last-position logits of five prompts (1, 7, 33, 64 and 100 tokens) and a
// 16-token greedy continuation of each. tools/hf_reference/make_hf_reference.py made them and its
// README says how. The models:
//   llama3_gqa  Llama, 8 query / 2 KV heads (GQA), explicit head_dim 16 != hidden 64 / 8 heads,
//               untied LM head, Llama-3.1 `llama3` RoPE scaling (factor 8, original max 32: prompts
//               of up to 116 positions hit the kept, the smoothed and the divided frequency bands).
//   qwen2_tied  Qwen2, 4 query / 2 KV heads, q/k/v biases, tied embeddings.
// Each is loaded from both config forms: config.json as transformers 5 writes it
// (`rope_parameters`) and config.classic.json (`rope_theta` + `rope_scaling`, transformers <= 4).
//
// The data must be there: a missing file is a failure, never a skip.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {
namespace {

constexpr int kGreedySteps = 16;

// Logit tolerance: max|ours - ref| <= 1e-3 * max(1, max|ref|), per prompt.
// Both sides compute in fp32 from bit-identical weights (every parameter was rounded to bf16 before
// transformers ran, and the checkpoint stores them in bf16, so our bf16->fp32 load is exact). They
// differ only in summation order and in how exp/rsqrt/cos/sin round; transformers' own fp32 result
// is 4e-5 from an (almost) fp64 evaluation of the same models (reference.json:
// fp32_vs_fp64_max_abs_logit_delta), against a tolerance of ~2.4e-2 here (logits reach ~25).
// The greedy top-1/top-2 margins are >= 0.057 (min_margin), so token equality is not flaky either.
constexpr double kRelTol = 1e-3;

double Tolerance(const std::vector<float>& ref) {
  double m = 1.0;
  for (float x : ref) m = std::max(m, std::abs(static_cast<double>(x)));
  return kRelTol * m;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    m = std::max(m, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return m;
}

// First index of the maximum, as torch.argmax.
int32_t Argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// top-1 minus top-2 logit.
double Margin(const std::vector<float>& v) {
  std::vector<float> s = v;
  std::partial_sort(s.begin(), s.begin() + 2, s.end(), std::greater<float>());
  return static_cast<double>(s[0]) - static_cast<double>(s[1]);
}

std::string HfDataDir(const std::string& model) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  std::string root = src != nullptr ? src : "";
  // ctest sets FLUXION_SOURCE_DIR (fluxion_cc_test); a bare run from the repo root works too.
  if (root.empty()) root = ".";
  return root + "/tests/data/hf/" + model;
}

struct Reference {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<float>> last_logits;
  std::vector<std::vector<int32_t>> greedy;
  std::vector<std::vector<double>> greedy_margins;
  double min_margin = 0;
  nlohmann::json mutations;
};

absl::StatusOr<Reference> LoadReference(const std::string& model) {
  const std::string path = HfDataDir(model) + "/reference.json";
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(path +
                               " is missing (FLUXION_SOURCE_DIR must point at the source "
                               "tree; the data is made by tools/hf_reference)");
  }
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::DataLossError(path + ": not valid JSON");
  Reference r;
  try {
    r.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
    r.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
    r.greedy_margins = j.at("greedy_margins").get<std::vector<std::vector<double>>>();
    r.min_margin = j.at("min_margin").get<double>();
    r.mutations = j.at("mutations");
    // Written from float32 values: the doubles convert back to the exact floats.
    for (const auto& row : j.at("last_logits")) {
      std::vector<float> v;
      for (const auto& x : row) v.push_back(static_cast<float>(x.get<double>()));
      r.last_logits.push_back(std::move(v));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(path + ": " + e.what());
  }
  if (r.prompts.empty() || r.prompts.size() != r.last_logits.size() ||
      r.prompts.size() != r.greedy.size() || r.prompts.size() != r.greedy_margins.size()) {
    return absl::DataLossError(path + ": prompts, last_logits, greedy, greedy_margins disagree");
  }
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    if (r.greedy[i].size() != kGreedySteps || r.greedy_margins[i].size() != kGreedySteps) {
      return absl::DataLossError(path + ": greedy continuations must have 16 tokens");
    }
  }
  return r;
}

enum class ConfigForm { kTransformers5, kClassic };

// A model and the checkpoint it was built from (kept alive alongside it).
struct Loaded {
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<Model> model;
};

absl::StatusOr<Loaded> LoadWithConfig(const std::string& model, const ModelConfig& config) {
  Loaded l;
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(HfDataDir(model));
  if (!ckpt.ok()) return ckpt.status();
  l.checkpoint = *std::move(ckpt);
  absl::StatusOr<std::unique_ptr<Model>> m = Model::FromCheckpoint(config, *l.checkpoint);
  if (!m.ok()) return m.status();
  l.model = *std::move(m);
  return l;
}

absl::StatusOr<ModelConfig> LoadConfig(const std::string& model, ConfigForm form) {
  return LoadModelConfig(HfDataDir(model) +
                         (form == ConfigForm::kClassic ? "/config.classic.json" : "/config.json"));
}

// config.json goes through Model::Load (the path a user takes); config.classic.json through
// LoadModelConfig + Checkpoint::Open + FromCheckpoint.
absl::StatusOr<Loaded> LoadModel(const std::string& model, ConfigForm form) {
  if (form == ConfigForm::kTransformers5) {
    Loaded l;
    absl::StatusOr<std::unique_ptr<Model>> m = Model::Load(HfDataDir(model));
    if (!m.ok()) return m.status();
    l.model = *std::move(m);
    return l;
  }
  absl::StatusOr<ModelConfig> config = LoadConfig(model, form);
  if (!config.ok()) return config.status();
  return LoadWithConfig(model, *config);
}

absl::StatusOr<std::vector<float>> PrefillLogits(const Model& model,
                                                 const std::vector<int32_t>& prompt) {
  auto seq = model.NewSequence();
  std::vector<float> logits;
  absl::Status s = model.Forward(*seq, prompt, &logits);
  if (!s.ok()) return s;
  return logits;
}

// ------------------------------------------------------------------------------------------------
// Every model x config form.

struct Case {
  const char* model;
  ConfigForm form;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << (c.form == ConfigForm::kClassic ? " (config.classic.json)" : " (config.json)");
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::string(info.param.model) +
         (info.param.form == ConfigForm::kClassic ? "_classic_config" : "_transformers5_config");
}

class HfReferenceTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    absl::StatusOr<Reference> ref = LoadReference(GetParam().model);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = *std::move(ref);
    absl::StatusOr<Loaded> loaded = LoadModel(GetParam().model, GetParam().form);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    loaded_ = *std::move(loaded);
  }
  const Model& model() const { return *loaded_.model; }

  Reference ref_;
  Loaded loaded_;
};

TEST_P(HfReferenceTest, PrefillLogitsMatchTransformers) {
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i) + " (" + std::to_string(ref_.prompts[i].size()) +
                 " tokens)");
    absl::StatusOr<std::vector<float>> logits = PrefillLogits(model(), ref_.prompts[i]);
    ASSERT_TRUE(logits.ok()) << logits.status();
    ASSERT_EQ(logits->size(), ref_.last_logits[i].size());
    EXPECT_LE(MaxAbsDiff(*logits, ref_.last_logits[i]), Tolerance(ref_.last_logits[i]));
  }
}

TEST_P(HfReferenceTest, Top1AfterPrefillMatchesTransformers) {
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    absl::StatusOr<std::vector<float>> logits = PrefillLogits(model(), ref_.prompts[i]);
    ASSERT_TRUE(logits.ok()) << logits.status();
    EXPECT_EQ(Argmax(*logits), Argmax(ref_.last_logits[i])) << "prompt " << i;
    EXPECT_EQ(Argmax(ref_.last_logits[i]), ref_.greedy[i][0]) << "reference data inconsistent";
  }
}

// Prefill, then one token per Forward on the same sequence (KV cache), feeding back our own
// argmax: the 16 tokens must be transformers' greedy tokens (computed there by full forward passes
// without a cache). Each step's top-1/top-2 margin must also match transformers' at that step,
// which checks the decode-step logits numerically, not only their argmax.
TEST_P(HfReferenceTest, GreedyTokensMatchTransformersWithIncrementalDecode) {
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    auto seq = model().NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(model().Forward(*seq, ref_.prompts[i], &logits).ok());
    std::vector<int32_t> ours;
    for (int step = 0; step < kGreedySteps; ++step) {
      if (step > 0) {
        const int32_t prev = ours.back();
        ASSERT_TRUE(model().Forward(*seq, absl::MakeConstSpan(&prev, 1), &logits).ok());
      }
      ours.push_back(Argmax(logits));
      EXPECT_NEAR(Margin(logits), ref_.greedy_margins[i][step], 2 * Tolerance(logits))
          << "step " << step;
    }
    EXPECT_EQ(seq->length(), static_cast<int64_t>(ref_.prompts[i].size()) + kGreedySteps - 1);
    EXPECT_EQ(ours, ref_.greedy[i]);
  }
}

// The prompt fed in chunks of 5 tokens (multi-token Forward calls on a non-empty cache).
TEST_P(HfReferenceTest, ChunkedPrefillMatchesTransformers) {
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    const std::vector<int32_t>& p = ref_.prompts[i];
    auto seq = model().NewSequence();
    std::vector<float> logits;
    for (size_t at = 0; at < p.size(); at += 5) {
      const size_t n = std::min<size_t>(5, p.size() - at);
      ASSERT_TRUE(model().Forward(*seq, absl::MakeConstSpan(p).subspan(at, n), &logits).ok());
    }
    EXPECT_LE(MaxAbsDiff(logits, ref_.last_logits[i]), Tolerance(ref_.last_logits[i]))
        << "prompt " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, HfReferenceTest,
                         ::testing::Values(Case{"llama3_gqa", ConfigForm::kTransformers5},
                                           Case{"llama3_gqa", ConfigForm::kClassic},
                                           Case{"qwen2_tied", ConfigForm::kTransformers5},
                                           Case{"qwen2_tied", ConfigForm::kClassic}),
                         CaseName);

// ------------------------------------------------------------------------------------------------
// The configs say what the models are, identically in both forms.

void ExpectSameConfig(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope.type, b.rope.type);
  EXPECT_EQ(a.rope.theta, b.rope.theta);
  EXPECT_EQ(a.rope.factor, b.rope.factor);
  EXPECT_EQ(a.rope.low_freq_factor, b.rope.low_freq_factor);
  EXPECT_EQ(a.rope.high_freq_factor, b.rope.high_freq_factor);
  EXPECT_EQ(a.rope.original_max_position_embeddings, b.rope.original_max_position_embeddings);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
  EXPECT_EQ(a.o_bias, b.o_bias);
  EXPECT_EQ(a.mlp_bias, b.mlp_bias);
}

TEST(HfReferenceConfigTest, LlamaConfigFormsBothReadAsLlama3ScaledGqaWithExplicitHeadDim) {
  for (ConfigForm form : {ConfigForm::kTransformers5, ConfigForm::kClassic}) {
    absl::StatusOr<ModelConfig> c = LoadConfig("llama3_gqa", form);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->architecture, Architecture::kLlama);
    EXPECT_EQ(c->hidden_size, 64);
    EXPECT_EQ(c->num_heads, 8);
    EXPECT_EQ(c->num_kv_heads, 2);
    EXPECT_EQ(c->head_dim, 16);  // explicit, not 64 / 8
    EXPECT_EQ(c->rope.type, RopeType::kLlama3);
    EXPECT_EQ(c->rope.theta, 10000.0);
    EXPECT_EQ(c->rope.factor, 8.0);
    EXPECT_EQ(c->rope.low_freq_factor, 1.0);
    EXPECT_EQ(c->rope.high_freq_factor, 4.0);
    EXPECT_EQ(c->rope.original_max_position_embeddings, 32);
    EXPECT_FALSE(c->tie_word_embeddings);
    EXPECT_FALSE(c->qkv_bias);
    EXPECT_EQ(c->torch_dtype, "bfloat16");  // transformers 5 writes "dtype"
  }
  absl::StatusOr<ModelConfig> a = LoadConfig("llama3_gqa", ConfigForm::kTransformers5);
  absl::StatusOr<ModelConfig> b = LoadConfig("llama3_gqa", ConfigForm::kClassic);
  ASSERT_TRUE(a.ok() && b.ok());
  ExpectSameConfig(*a, *b);
}

TEST(HfReferenceConfigTest, Qwen2ConfigFormsBothReadAsTiedWithQkvBias) {
  for (ConfigForm form : {ConfigForm::kTransformers5, ConfigForm::kClassic}) {
    absl::StatusOr<ModelConfig> c = LoadConfig("qwen2_tied", form);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->architecture, Architecture::kQwen2);
    EXPECT_EQ(c->num_heads, 4);
    EXPECT_EQ(c->num_kv_heads, 2);
    EXPECT_EQ(c->head_dim, 16);
    EXPECT_EQ(c->rope.type, RopeType::kDefault);
    EXPECT_EQ(c->rope.theta, 10000.0);
    EXPECT_TRUE(c->tie_word_embeddings);
    EXPECT_TRUE(c->qkv_bias);
    EXPECT_FALSE(c->o_bias);
  }
  absl::StatusOr<ModelConfig> a = LoadConfig("qwen2_tied", ConfigForm::kTransformers5);
  absl::StatusOr<ModelConfig> b = LoadConfig("qwen2_tied", ConfigForm::kClassic);
  ASSERT_TRUE(a.ok() && b.ok());
  ExpectSameConfig(*a, *b);
}

// ------------------------------------------------------------------------------------------------
// Mutations: the comparisons above would catch these bugs. Each mutant must move the logits of the
// longest prompt by more than 100 tolerances. Where transformers ran the same mutant
// (reference.json "mutations"), our mutant's distance from the reference must also equal
// transformers' (within 2 tolerances: max|a - r| is 1-Lipschitz in a, and both our mutant and our
// reference-model logits are each within one tolerance of transformers').

struct MutantResult {
  double delta = 0;
  double tol = 0;
};

absl::StatusOr<MutantResult> RunMutant(const std::string& model, const Reference& ref,
                                       const ModelConfig& mutant) {
  absl::StatusOr<Loaded> l = LoadWithConfig(model, mutant);
  if (!l.ok()) return l.status();
  absl::StatusOr<std::vector<float>> logits = PrefillLogits(*l->model, ref.prompts.back());
  if (!logits.ok()) return logits.status();
  return MutantResult{MaxAbsDiff(*logits, ref.last_logits.back()),
                      Tolerance(ref.last_logits.back())};
}

TEST(HfReferenceMutationTest, LlamaIgnoringLlama3RopeScalingIsDetected) {
  absl::StatusOr<Reference> ref = LoadReference("llama3_gqa");
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<ModelConfig> c = LoadConfig("llama3_gqa", ConfigForm::kTransformers5);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->rope.type, RopeType::kLlama3);
  c->rope.type = RopeType::kDefault;  // same theta, scaling ignored
  absl::StatusOr<MutantResult> r = RunMutant("llama3_gqa", *ref, *c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->delta, 100 * r->tol);
  EXPECT_NEAR(r->delta, ref->mutations.at("rope_scaling_ignored").get<double>(), 2 * r->tol);
}

TEST(HfReferenceMutationTest, Qwen2DoublingRopeThetaIsDetected) {
  absl::StatusOr<Reference> ref = LoadReference("qwen2_tied");
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<ModelConfig> c = LoadConfig("qwen2_tied", ConfigForm::kTransformers5);
  ASSERT_TRUE(c.ok()) << c.status();
  c->rope.theta *= 2;
  absl::StatusOr<MutantResult> r = RunMutant("qwen2_tied", *ref, *c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->delta, 100 * r->tol);
  EXPECT_NEAR(r->delta, ref->mutations.at("rope_theta_doubled").get<double>(), 2 * r->tol);
}

// Dropping the q/k/v biases must never pass silently: either loading refuses the checkpoint's bias
// tensors, or the logits move far (transformers: by reference.json mutations.qkv_bias_zeroed).
TEST(HfReferenceMutationTest, Qwen2IgnoringQkvBiasIsRejectedOrDetected) {
  absl::StatusOr<Reference> ref = LoadReference("qwen2_tied");
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<ModelConfig> c = LoadConfig("qwen2_tied", ConfigForm::kTransformers5);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->qkv_bias);
  c->qkv_bias = false;
  absl::StatusOr<MutantResult> r = RunMutant("qwen2_tied", *ref, *c);
  if (r.ok()) {  // the bias tensors are ignored: then the logits must be transformers' mutant's
    EXPECT_GT(r->delta, 100 * r->tol);
    EXPECT_NEAR(r->delta, ref->mutations.at("qkv_bias_zeroed").get<double>(), 2 * r->tol);
  } else {
    EXPECT_NE(r.status().message().find("bias"), std::string::npos) << r.status();
  }
}

// An explicit head_dim that is ignored (hidden / heads = 8 instead of 16) cannot load: the q/k/v/o
// tensors have the wrong shapes, and the error says which.
TEST(HfReferenceMutationTest, LlamaWithDerivedInsteadOfExplicitHeadDimIsRejected) {
  absl::StatusOr<ModelConfig> c = LoadConfig("llama3_gqa", ConfigForm::kTransformers5);
  ASSERT_TRUE(c.ok()) << c.status();
  c->head_dim = c->hidden_size / c->num_heads;
  absl::StatusOr<Loaded> l = LoadWithConfig("llama3_gqa", *c);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("proj"), std::string::npos) << l.status();
}

}  // namespace
}  // namespace fluxion::model
