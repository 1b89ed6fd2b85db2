#include "model/config.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::model {
namespace {

using ::testing::HasSubstr;

// Llama-3.1-8B's config.json as transformers 4.43 wrote it.
constexpr char kLlama31Classic[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})json";

// The same model as transformers 5 writes it: `dtype`, and RoPE folded into `rope_parameters`.
constexpr char kLlama31Transformers5[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": [128001, 128008, 128009],
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": false,
  "transformers_version": "5.0.0",
  "vocab_size": 128256
})json";

// Qwen2.5-0.5B's config.json.
constexpr char kQwen25[] = R"json({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 32768,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_mrope": false,
  "use_sliding_window": false,
  "vocab_size": 151936
})json";

// A small Llama config that tests edit one field at a time.
constexpr char kSmallLlama[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 264,
  "hidden_size": 256,
  "intermediate_size": 768,
  "num_hidden_layers": 4,
  "num_attention_heads": 8,
  "num_key_value_heads": 2,
  "max_position_embeddings": 16384,
  "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0,
  "rope_scaling": null,
  "eos_token_id": 257,
  "bos_token_id": 256
})json";

// kSmallLlama with `from` replaced by `to`; fails the test if `from` is absent.
std::string SmallLlamaWith(absl::string_view from, absl::string_view to) {
  std::string text = kSmallLlama;
  EXPECT_THAT(text, HasSubstr(std::string(from)));
  return absl::StrReplaceAll(text, {{from, to}});
}

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
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
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
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.pad_token_id, b.pad_token_id);
  EXPECT_EQ(a.torch_dtype, b.torch_dtype);
}

// Expects `json` to be rejected with InvalidArgument whose message contains `field`.
void ExpectRejectedNaming(const std::string& json, absl::string_view field) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(json);
  ASSERT_FALSE(config.ok()) << "accepted config expected to fail on " << field;
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << config.status();
  EXPECT_THAT(config.status().message(), HasSubstr(std::string(field)));
}

TEST(ModelConfigTest, ParsesLlama31ClassicConfigWithLlama3Scaling) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(kLlama31Classic);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, Architecture::kLlama);
  EXPECT_EQ(config->vocab_size, 128256);
  EXPECT_EQ(config->hidden_size, 4096);
  EXPECT_EQ(config->intermediate_size, 14336);
  EXPECT_EQ(config->num_layers, 32);
  EXPECT_EQ(config->num_heads, 32);
  EXPECT_EQ(config->num_kv_heads, 8);
  EXPECT_EQ(config->group_size(), 4);
  EXPECT_EQ(config->head_dim, 128);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-5);
  EXPECT_EQ(config->max_position_embeddings, 131072);
  EXPECT_EQ(config->rope.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(config->rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(config->rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(config->rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(config->rope.high_freq_factor, 4.0);
  EXPECT_EQ(config->rope.original_max_position_embeddings, 8192);
  EXPECT_FALSE(config->tie_word_embeddings);
  EXPECT_FALSE(config->qkv_bias);
  EXPECT_FALSE(config->o_bias);
  EXPECT_FALSE(config->mlp_bias);
  EXPECT_EQ(config->eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(config->bos_token_id, 128000);
  EXPECT_EQ(config->torch_dtype, "bfloat16");
}

TEST(ModelConfigTest, Transformers5FormParsesToTheSameConfigAsClassicForm) {
  absl::StatusOr<ModelConfig> classic = ParseModelConfig(kLlama31Classic);
  absl::StatusOr<ModelConfig> v5 = ParseModelConfig(kLlama31Transformers5);
  ASSERT_TRUE(classic.ok()) << classic.status();
  ASSERT_TRUE(v5.ok()) << v5.status();
  ExpectSameConfig(*classic, *v5);
}

TEST(ModelConfigTest, ParsesQwen25WithTiedEmbeddingsAndQkvBias) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(kQwen25);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, Architecture::kQwen2);
  EXPECT_EQ(config->vocab_size, 151936);
  EXPECT_EQ(config->hidden_size, 896);
  EXPECT_EQ(config->intermediate_size, 4864);
  EXPECT_EQ(config->num_layers, 24);
  EXPECT_EQ(config->num_heads, 14);
  EXPECT_EQ(config->num_kv_heads, 2);
  EXPECT_EQ(config->group_size(), 7);
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-6);
  EXPECT_EQ(config->rope.type, RopeType::kDefault);
  EXPECT_DOUBLE_EQ(config->rope.theta, 1e6);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_TRUE(config->qkv_bias);
  EXPECT_FALSE(config->o_bias);
  EXPECT_FALSE(config->mlp_bias);
  EXPECT_EQ(config->eos_token_ids, (std::vector<int64_t>{151643}));
  EXPECT_EQ(config->bos_token_id, 151643);
}

// Mistral-7B-Instruct-v0.3's config.json (no sliding window: Llama's arithmetic).
constexpr char kMistral7bV03[] = R"({
  "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0",
  "use_cache": true, "vocab_size": 32768})";

TEST(ModelConfigTest, ParsesMistralAsLlamasLayoutAndRefusesAWindowThatBites) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(kMistral7bV03);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, Architecture::kMistral);
  EXPECT_EQ(config->head_dim, 128);
  EXPECT_EQ(config->group_size(), 4);
  EXPECT_DOUBLE_EQ(config->rope.theta, 1e6);
  EXPECT_FALSE(config->qkv_bias || config->o_bias || config->mlp_bias);
  EXPECT_EQ(config->eos_token_ids, (std::vector<int64_t>{2}));
  absl::StatusOr<ModelConfig> reparsed = ParseModelConfig(ModelConfigToJson(*config));
  ASSERT_TRUE(reparsed.ok()) << reparsed.status();
  ExpectSameConfig(*config, *reparsed);
  // Mistral-7B v0.1: a 4096-token window over a 32768-token context, which we do not run.
  ExpectRejectedNaming(absl::StrReplaceAll(kMistral7bV03, {{R"("sliding_window": null)",
                                                            R"("sliding_window": 4096)"}}),
                       "sliding_window 4096");
  // A window as long as the context never bites.
  EXPECT_TRUE(ParseModelConfig(absl::StrReplaceAll(kMistral7bV03, {{R"("sliding_window": null)",
                                                                     R"("sliding_window": 32768)"}}))
                  .ok());
}

TEST(ModelConfigTest, ModelTypeAloneSelectsTheArchitecture) {
  std::string text =
      absl::StrReplaceAll(kQwen25, {{R"("architectures": ["Qwen2ForCausalLM"],)", ""}});
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, Architecture::kQwen2);
}

TEST(ModelConfigTest, ExplicitHeadDimOverridesHiddenOverHeads) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(SmallLlamaWith(
      R"("num_key_value_heads": 2,)", R"("num_key_value_heads": 2, "head_dim": 64,)"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head_dim, 64);  // not 256 / 8
}

TEST(ModelConfigTest, NullHeadDimIsDerivedFromHiddenSize) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(SmallLlamaWith(
      R"("num_key_value_heads": 2,)", R"("num_key_value_heads": 2, "head_dim": null,)"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head_dim, 32);
}

TEST(ModelConfigTest, MultiQueryAttentionHasOneKvHeadServingAllQueryHeads) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(
      SmallLlamaWith(R"("num_key_value_heads": 2)", R"("num_key_value_heads": 1)"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_kv_heads, 1);
  EXPECT_EQ(config->group_size(), 8);
}

TEST(ModelConfigTest, MissingKvHeadCountMeansMultiHeadAttention) {
  absl::StatusOr<ModelConfig> config =
      ParseModelConfig(SmallLlamaWith(R"("num_key_value_heads": 2,)", ""));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_kv_heads, 8);
  EXPECT_EQ(config->group_size(), 1);
}

TEST(ModelConfigTest, EosTokenMayBeAListOrNull) {
  absl::StatusOr<ModelConfig> list =
      ParseModelConfig(SmallLlamaWith(R"("eos_token_id": 257)", R"("eos_token_id": [257, 258])"));
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->eos_token_ids, (std::vector<int64_t>{257, 258}));

  absl::StatusOr<ModelConfig> none = ParseModelConfig(SmallLlamaWith(
      R"("eos_token_id": 257,
  "bos_token_id": 256)",
      R"("eos_token_id": null)"));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->eos_token_ids.empty());
  EXPECT_EQ(none->bos_token_id, -1);
}

TEST(ModelConfigTest, PadTokenIsReadAndCheckedAgainstTheVocabulary) {
  auto absent = ParseModelConfig(kSmallLlama);
  ASSERT_TRUE(absent.ok()) << absent.status();
  EXPECT_EQ(absent->pad_token_id, -1);
  auto pad = ParseModelConfig(SmallLlamaWith(R"("bos_token_id": 256)",
                                             R"("bos_token_id": 256, "pad_token_id": 258)"));
  ASSERT_TRUE(pad.ok()) << pad.status();
  EXPECT_EQ(pad->pad_token_id, 258);
  auto null_pad = ParseModelConfig(SmallLlamaWith(R"("bos_token_id": 256)",
                                                  R"("bos_token_id": 256, "pad_token_id": null)"));
  ASSERT_TRUE(null_pad.ok()) << null_pad.status();
  EXPECT_EQ(null_pad->pad_token_id, -1);
  ExpectRejectedNaming(SmallLlamaWith(R"("bos_token_id": 256)",
                                      R"("bos_token_id": 256, "pad_token_id": 264)"),
                       "pad_token_id");
  ExpectRejectedNaming(SmallLlamaWith(R"("bos_token_id": 256)",
                                      R"("bos_token_id": 256, "pad_token_id": -2)"),
                       "pad_token_id");
}

TEST(ModelConfigTest, LlamaAttentionBiasCoversQkvAndOutputProjections) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(
      SmallLlamaWith(R"("rope_scaling": null,)",
                     R"("rope_scaling": null, "attention_bias": true, "mlp_bias": true,)"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->qkv_bias);
  EXPECT_TRUE(config->o_bias);
  EXPECT_TRUE(config->mlp_bias);
}

TEST(ModelConfigTest, LinearScalingWithLegacyTypeKeyIsRead) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(SmallLlamaWith(
      R"("rope_scaling": null)", R"("rope_scaling": {"type": "linear", "factor": 2.0})"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->rope.type, RopeType::kLinear);
  EXPECT_DOUBLE_EQ(config->rope.factor, 2.0);
}

TEST(ModelConfigTest, MissingRopeThetaDefaultsToTenThousand) {
  absl::StatusOr<ModelConfig> config =
      ParseModelConfig(SmallLlamaWith(R"("rope_theta": 500000.0,)", ""));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_DOUBLE_EQ(config->rope.theta, 10000.0);
  EXPECT_EQ(config->rope.type, RopeType::kDefault);
}

TEST(ModelConfigTest, DisabledSlidingWindowIsAccepted) {
  // kQwen25 carries sliding_window 32768 with use_sliding_window false.
  EXPECT_TRUE(ParseModelConfig(kQwen25).ok());
  std::string on_but_wide = absl::StrReplaceAll(
      kQwen25, {{R"("use_sliding_window": false)", R"("use_sliding_window": true)"}});
  EXPECT_TRUE(ParseModelConfig(on_but_wide).ok()) << "a window as long as the context never bites";
}

TEST(ModelConfigTest, MissingHiddenSizeIsRejectedNamingTheField) {
  ExpectRejectedNaming(SmallLlamaWith(R"("hidden_size": 256,)", ""), "hidden_size");
}

TEST(ModelConfigTest, HeadsNotDivisibleByKvHeadsIsRejectedNamingTheField) {
  ExpectRejectedNaming(SmallLlamaWith(R"("num_key_value_heads": 2)", R"("num_key_value_heads": 3)"),
                       "num_key_value_heads");
}

TEST(ModelConfigTest, UnsupportedRopeTypeIsRejectedInBothForms) {
  ExpectRejectedNaming(SmallLlamaWith(R"("rope_scaling": null)",
                                      R"("rope_scaling": {"rope_type": "yarn", "factor": 4.0})"),
                       "rope_scaling type 'yarn' is not supported");
  ExpectRejectedNaming(SmallLlamaWith(R"("rope_theta": 500000.0,
  "rope_scaling": null,)",
                                      R"("rope_parameters": {"rope_type": "dynamic",
                                          "rope_theta": 10000.0, "factor": 2.0},)"),
                       "rope_scaling type 'dynamic' is not supported");
}

TEST(ModelConfigTest, Llama3ScalingWithoutLowFreqFactorIsRejectedNamingIt) {
  std::string text = absl::StrReplaceAll(kLlama31Classic, {{R"("low_freq_factor": 1.0,)", ""}});
  ExpectRejectedNaming(text, "rope_scaling.low_freq_factor");
  text = absl::StrReplaceAll(kLlama31Transformers5, {{R"("low_freq_factor": 1.0,)", ""}});
  ExpectRejectedNaming(text, "rope_parameters.low_freq_factor");
}

TEST(ModelConfigTest, StringWhereIntegerExpectedIsRejectedNamingTheField) {
  ExpectRejectedNaming(SmallLlamaWith(R"("hidden_size": 256)", R"("hidden_size": "256")"),
                       "hidden_size");
}

TEST(ModelConfigTest, FractionalSizeIsRejectedNamingTheField) {
  ExpectRejectedNaming(SmallLlamaWith(R"("num_hidden_layers": 4)", R"("num_hidden_layers": 4.5)"),
                       "num_hidden_layers");
}

TEST(ModelConfigTest, SlidingWindowShorterThanContextIsRejected) {
  std::string text = absl::StrReplaceAll(
      kQwen25, {{R"("sliding_window": 32768)", R"("sliding_window": 4096)"},
                {R"("use_sliding_window": false)", R"("use_sliding_window": true)"}});
  ExpectRejectedNaming(text, "sliding_window");
}

TEST(ModelConfigTest, OddHeadDimIsRejectedNamingTheField) {
  ExpectRejectedNaming(SmallLlamaWith(R"("num_key_value_heads": 2,)",
                                      R"("num_key_value_heads": 2, "head_dim": 33,)"),
                       "head_dim");
}

TEST(ModelConfigTest, NonPositiveSizeIsRejectedNamingTheField) {
  ExpectRejectedNaming(SmallLlamaWith(R"("vocab_size": 264)", R"("vocab_size": 0)"), "vocab_size");
  ExpectRejectedNaming(SmallLlamaWith(R"("intermediate_size": 768)", R"("intermediate_size": -1)"),
                       "intermediate_size");
}

TEST(ModelConfigTest, UnknownArchitectureIsRejectedNamingIt) {
  ExpectRejectedNaming(SmallLlamaWith(R"(["LlamaForCausalLM"])", R"(["GemmaForCausalLM"])"),
                       "GemmaForCausalLM");
}

TEST(ModelConfigTest, NonSiluActivationIsRejected) {
  ExpectRejectedNaming(SmallLlamaWith(R"("model_type": "llama",)",
                                      R"("model_type": "llama", "hidden_act": "gelu",)"),
                       "hidden_act");
}

TEST(ModelConfigTest, BadEosListEntryIsRejectedNamingTheField) {
  ExpectRejectedNaming(SmallLlamaWith(R"("eos_token_id": 257)", R"("eos_token_id": [257, "x"])"),
                       "eos_token_id[1]");
}

TEST(ModelConfigTest, MalformedJsonIsInvalidArgument) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(R"({"hidden_size": 256,)");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("not valid JSON"));

  config = ParseModelConfig("[1, 2]");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
}

// Found by an attacker: 2^59 + 8 heads times head_dim 32 wraps int64 to 256 = the q_proj width of
// a small model, so the shape check passed and RoPE overflowed its buffer.
TEST(ModelConfigTest, HeadCountWhoseProductWithHeadDimOverflowsIsRejected) {
  ExpectRejectedNaming(
      SmallLlamaWith(R"("num_attention_heads": 8,
  "num_key_value_heads": 2,)",
                     R"("num_attention_heads": 576460752303423496,
  "num_key_value_heads": 2, "head_dim": 32,)"),
      "num_attention_heads");
}

// Each of these ended in an uncaught bad_alloc or length_error when the model was built.
TEST(ModelConfigTest, SizesAboveTheLimitsAreRejectedNamingTheField) {
  ExpectRejectedNaming(
      SmallLlamaWith(R"("num_hidden_layers": 4)", R"("num_hidden_layers": 2147483648)"),
      "num_hidden_layers");
  ExpectRejectedNaming(SmallLlamaWith(R"("num_key_value_heads": 2,)",
                                      R"("num_key_value_heads": 2, "head_dim": 1099511627776,)"),
                       "head_dim");
  ExpectRejectedNaming(SmallLlamaWith(R"("vocab_size": 264)", R"("vocab_size": 4294967296)"),
                       "vocab_size");
  ExpectRejectedNaming(SmallLlamaWith(R"("hidden_size": 256)", R"("hidden_size": 1048576)"),
                       "hidden_size");
  ExpectRejectedNaming(
      SmallLlamaWith(R"("intermediate_size": 768)", R"("intermediate_size": 9007199254740992)"),
      "intermediate_size");
  ExpectRejectedNaming(SmallLlamaWith(R"("max_position_embeddings": 16384)",
                                      R"("max_position_embeddings": 9223372036854775807)"),
                       "max_position_embeddings");
  ExpectRejectedNaming(
      SmallLlamaWith(R"("num_key_value_heads": 2)", R"("num_key_value_heads": 4096)"),
      "num_key_value_heads");
}

TEST(ModelConfigTest, SizesAtTheLimitsPassTheSizeChecks) {
  // The largest published dense model is far inside the limits.
  absl::StatusOr<ModelConfig> config = ParseModelConfig(SmallLlamaWith(
      R"("num_hidden_layers": 4)", absl::StrCat(R"("num_hidden_layers": )", kMaxLayers)));
  EXPECT_TRUE(config.ok()) << config.status();
}

TEST(ModelConfigTest, NonFiniteOrHugeRopeValuesAreRejectedNamingTheField) {
  ExpectRejectedNaming(SmallLlamaWith(R"("rope_theta": 500000.0)", R"("rope_theta": 1e400)"),
                       "not valid JSON");
  ExpectRejectedNaming(
      SmallLlamaWith(R"("rope_scaling": null)",
                     R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 9223372036854775807})"),
      "rope_scaling.original_max_position_embeddings");
}

TEST(ModelConfigTest, TokenIdsOutsideTheLimitsAreRejectedNamingTheField) {
  ExpectRejectedNaming(SmallLlamaWith(R"("bos_token_id": 256)", R"("bos_token_id": 264)"),
                       "bos_token_id");
  ExpectRejectedNaming(SmallLlamaWith(R"("eos_token_id": 257)", R"("eos_token_id": 4294967296)"),
                       "eos_token_id");
  std::string many = "[";
  for (int i = 0; i <= kMaxTokenIds; ++i) absl::StrAppend(&many, i == 0 ? "" : ",", 1);
  many += "]";
  ExpectRejectedNaming(SmallLlamaWith(R"("eos_token_id": 257)",
                                      absl::StrCat(R"("eos_token_id": )", many)),
                       "eos_token_id");
}

// Found by an attacker: nesting 100,000 deep overflowed the stack in nlohmann's recursion.
TEST(ModelConfigTest, DeeplyNestedJsonIsRejectedWithoutRecursingIntoIt) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  ExpectRejectedNaming(SmallLlamaWith(R"("rope_scaling": null)",
                                      absl::StrCat(R"("rope_scaling": )", deep)),
                       "nested deeper than");
  ExpectRejectedNaming(deep, "nested deeper than");
}

TEST(ModelConfigTest, OversizedConfigIsRejectedBeforeParsing) {
  const std::string big = SmallLlamaWith(
      R"("model_type": "llama",)",
      absl::StrCat(R"("model_type": "llama", "pad": ")", std::string(kMaxConfigBytes, 'x'),
                   R"(",)"));
  ExpectRejectedNaming(big, "above the limit");
  ScopedTestTempDir temp;
  const std::string path = (temp.path() / "config.json").string();
  {
    std::ofstream out(path);
    out << big;
  }
  absl::StatusOr<ModelConfig> config = LoadModelConfig(path);
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("larger than the limit"));
}

TEST(ModelConfigTest, ToJsonRoundTripsEveryField) {
  for (const char* text : {kLlama31Classic, kQwen25}) {
    absl::StatusOr<ModelConfig> original = ParseModelConfig(text);
    ASSERT_TRUE(original.ok()) << original.status();
    absl::StatusOr<ModelConfig> reparsed = ParseModelConfig(ModelConfigToJson(*original));
    ASSERT_TRUE(reparsed.ok()) << reparsed.status();
    ExpectSameConfig(*original, *reparsed);
  }
}

TEST(ModelConfigTest, ToJsonRoundTripsAHandBuiltConfig) {
  ModelConfig config;
  config.vocab_size = 264;
  config.hidden_size = 256;
  config.intermediate_size = 768;
  config.num_layers = 4;
  config.num_heads = 8;
  config.num_kv_heads = 2;
  config.head_dim = 48;  // deliberately not hidden / heads
  config.rms_norm_eps = 1.25e-5;
  config.max_position_embeddings = 16384;
  config.rope.type = RopeType::kLinear;
  config.rope.theta = 123456.75;
  config.rope.factor = 3.5;
  config.tie_word_embeddings = true;
  config.qkv_bias = config.o_bias = config.mlp_bias = true;
  config.eos_token_ids = {257};
  config.torch_dtype = "float32";

  const std::string json = ModelConfigToJson(config);
  EXPECT_THAT(json, HasSubstr(R"("architectures")"));
  EXPECT_THAT(json, HasSubstr(R"("model_type": "llama")"));
  absl::StatusOr<ModelConfig> reparsed = ParseModelConfig(json);
  ASSERT_TRUE(reparsed.ok()) << reparsed.status() << "\n" << json;
  ExpectSameConfig(config, *reparsed);
}


TEST(ModelConfigTest, LoadModelConfigReadsAFileAndReportsAMissingOne) {
  ScopedTestTempDir temp;
  const std::filesystem::path& dir = temp.path();
  const std::string path = (dir / "config.json").string();
  {
    std::ofstream out(path);
    out << kQwen25;
  }
  absl::StatusOr<ModelConfig> config = LoadModelConfig(path);
  EXPECT_TRUE(config.ok()) << config.status();

  absl::StatusOr<ModelConfig> missing = LoadModelConfig((dir / "absent.json").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("absent.json"));

  {
    std::ofstream out(path);
    out << SmallLlamaWith(R"("hidden_size": 256,)", "");
  }
  absl::StatusOr<ModelConfig> bad = LoadModelConfig(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr(path));
  EXPECT_THAT(bad.status().message(), HasSubstr("hidden_size"));
}

}  // namespace
}  // namespace fluxion::model
