#include "model/random_model.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "model/safetensors.h"

namespace fluxion::model {
namespace {

enum class Init { kNormal, kNorm, kBias };

// Tensors are filled from independent streams (seed, tensor index) so adding a tensor does not
// change the others.
TensorToWrite RandomTensor(const std::string& name, std::vector<int64_t> shape, Init init,
                           float std_dev, uint64_t seed, uint64_t index) {
  TensorToWrite t;
  t.name = name;
  t.dtype = DType::kBF16;
  t.shape = std::move(shape);
  int64_t numel = 1;
  for (int64_t s : t.shape) numel *= s;
  t.data.resize(numel * sizeof(bf16));
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + index);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto* out = reinterpret_cast<bf16*>(t.data.data());
  for (int64_t i = 0; i < numel; ++i) {
    float v = normal(rng) * std_dev;
    if (init == Init::kNorm) v += 1.0f;  // RMSNorm gains near 1
    out[i] = FloatToBf16(v);
  }
  return t;
}

}  // namespace

std::vector<std::string> PresetNames() {
  return {"tiny", "qwen2.5-0.5b", "llama3.1-8b", "qwen2.5-7b"};
}

absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset) {
  ModelConfig c;
  if (preset == "tiny") {
    c.architecture = Architecture::kLlama;
    c.vocab_size = 512;
    c.hidden_size = 128;
    c.intermediate_size = 384;
    c.num_layers = 4;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = 16;
    c.rms_norm_eps = 1e-5;
    c.max_position_embeddings = 32768;
    c.rope = RopeConfig{RopeType::kLlama3, 500000.0, 8.0, 1.0, 4.0, 8192};
    c.eos_token_ids = {2};
    c.bos_token_id = 1;
    c.torch_dtype = "bfloat16";
  } else if (preset == "qwen2.5-0.5b") {
    c.architecture = Architecture::kQwen2;
    c.vocab_size = 151936;
    c.hidden_size = 896;
    c.intermediate_size = 4864;
    c.num_layers = 24;
    c.num_heads = 14;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.rms_norm_eps = 1e-6;
    c.max_position_embeddings = 32768;
    c.rope = RopeConfig{RopeType::kDefault, 1000000.0};
    c.tie_word_embeddings = true;
    c.qkv_bias = true;
    c.eos_token_ids = {151643};
    c.bos_token_id = 151643;
    c.torch_dtype = "bfloat16";
  } else if (preset == "llama3.1-8b") {
    // Meta-Llama-3.1-8B's config.json.
    c.architecture = Architecture::kLlama;
    c.vocab_size = 128256;
    c.hidden_size = 4096;
    c.intermediate_size = 14336;
    c.num_layers = 32;
    c.num_heads = 32;
    c.num_kv_heads = 8;
    c.head_dim = 128;
    c.rms_norm_eps = 1e-5;
    c.max_position_embeddings = 131072;
    c.rope = RopeConfig{RopeType::kLlama3, 500000.0, 8.0, 1.0, 4.0, 8192};
    c.eos_token_ids = {128001, 128008, 128009};
    c.bos_token_id = 128000;
    c.torch_dtype = "bfloat16";
  } else if (preset == "qwen2.5-7b") {
    // Qwen2.5-7B's config.json (its 128K mode is YaRN on top; the shapes are these).
    c.architecture = Architecture::kQwen2;
    c.vocab_size = 152064;
    c.hidden_size = 3584;
    c.intermediate_size = 18944;
    c.num_layers = 28;
    c.num_heads = 28;
    c.num_kv_heads = 4;
    c.head_dim = 128;
    c.rms_norm_eps = 1e-6;
    c.max_position_embeddings = 131072;
    c.rope = RopeConfig{RopeType::kDefault, 1000000.0};
    c.qkv_bias = true;
    c.eos_token_ids = {151643, 151645};
    c.bos_token_id = 151643;
    c.torch_dtype = "bfloat16";
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown preset '", preset,
                                                   "'; known presets: ",
                                                   absl::StrJoin(PresetNames(), ", ")));
  }
  return c;
}

absl::Status WriteRandomModel(const ModelConfig& c, uint64_t seed, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  const int64_t h = c.hidden_size, d = c.head_dim, f = c.intermediate_size;
  const float in_h = 1.0f / std::sqrt(static_cast<float>(h));
  std::vector<TensorToWrite> tensors;
  uint64_t index = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, Init init, float sd) {
    tensors.push_back(RandomTensor(name, std::move(shape), init, sd, seed, index++));
  };
  add("model.embed_tokens.weight", {c.vocab_size, h}, Init::kNormal, 1.0f);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", {h}, Init::kNorm, 0.1f);
    for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
      const int64_t out = proj[0] == 'q' ? c.num_heads * d : c.num_kv_heads * d;
      add(p + "self_attn." + proj + ".weight", {out, h}, Init::kNormal, in_h);
      if (c.qkv_bias) add(p + "self_attn." + proj + ".bias", {out}, Init::kBias, 0.1f);
    }
    add(p + "self_attn.o_proj.weight", {h, c.num_heads * d}, Init::kNormal,
        1.0f / std::sqrt(static_cast<float>(c.num_heads * d)));
    if (c.o_bias) add(p + "self_attn.o_proj.bias", {h}, Init::kBias, 0.1f);
    add(p + "post_attention_layernorm.weight", {h}, Init::kNorm, 0.1f);
    add(p + "mlp.gate_proj.weight", {f, h}, Init::kNormal, in_h);
    add(p + "mlp.up_proj.weight", {f, h}, Init::kNormal, in_h);
    add(p + "mlp.down_proj.weight", {h, f}, Init::kNormal,
        1.0f / std::sqrt(static_cast<float>(f)));
    if (c.mlp_bias) {
      add(p + "mlp.gate_proj.bias", {f}, Init::kBias, 0.1f);
      add(p + "mlp.up_proj.bias", {f}, Init::kBias, 0.1f);
      add(p + "mlp.down_proj.bias", {h}, Init::kBias, 0.1f);
    }
  }
  add("model.norm.weight", {h}, Init::kNorm, 0.1f);
  // A gain of 4 on the output head (std 4/sqrt(h)) gives logits with a spread of a few units.
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h}, Init::kNormal, 4 * in_h);
  FLUXION_RETURN_IF_ERROR(
      WriteSafetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}}));
  std::ofstream config_file(dir + "/config.json");
  config_file << ModelConfigToJson(c);
  config_file.close();
  if (!config_file) {
    return absl::InternalError(absl::StrCat("cannot write ", dir, "/config.json: ",
                                            std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace fluxion::model
