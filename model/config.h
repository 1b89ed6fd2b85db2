// Model hyper-parameters read from a Hugging Face `config.json`.
//
// Accepted: LlamaForCausalLM (incl. Llama-3.1 `llama3` RoPE scaling) and Qwen2ForCausalLM
// (Qwen2/Qwen2.5: q/k/v bias, usually tied embeddings), in both config forms:
//   classic (transformers <= 4.x):  "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", ...}
//   transformers 5:                 "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, ...}
// Anything we cannot run faithfully (an unknown architecture, an unsupported RoPE type, a sliding
// window that would actually bite) is rejected with InvalidArgument naming the field, rather than
// run with silently wrong math.
//
// Limits. Every size in the file is checked against the limits below, and every product the
// runtime forms from them (heads x head_dim, layers x kv_heads x head_dim, ...) is checked for
// int64 overflow, before anything is allocated, so that a hostile or corrupt config.json gives
// InvalidArgument naming the field instead of an overflowed buffer size, bad_alloc or
// length_error. The limits are a few times the largest published dense models (Llama-3.1-405B:
// hidden 16384, intermediate 53248, 126 layers, 128 heads, head_dim 128, 131072 positions;
// Qwen2.5-72B: vocabulary 152064) so that no real config comes near them, while keeping each
// derived size far from int64 and size_t overflow. docs/FUZZING.md ("Input limits").
//
// Thread-safe: a plain value type.
#ifndef FLUXION_MODEL_CONFIG_H_
#define FLUXION_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fluxion::model {

inline constexpr int64_t kMaxVocabSize = int64_t{1} << 24;          // 16.7M ids; fits int32
inline constexpr int64_t kMaxHiddenSize = int64_t{1} << 17;         // 131072
inline constexpr int64_t kMaxIntermediateSize = int64_t{1} << 20;   // 1048576
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxHeads = 1024;                          // query and KV heads each
inline constexpr int64_t kMaxHeadDim = 4096;
inline constexpr int64_t kMaxPositionEmbeddings = int64_t{1} << 24;  // 16.7M positions
inline constexpr int64_t kMaxTokenIds = 1024;  // entries of the eos_token_id list
inline constexpr size_t kMaxConfigBytes = size_t{16} << 20;  // config.json file size
inline constexpr int kMaxJsonDepth = 64;  // nesting of config.json and safetensors headers

// kMistral is Llama's layout and arithmetic (no biases); it differs in its sliding window, which
// applies whenever config.json gives one: we serve it only when the window never bites
// (sliding_window null or >= max_position_embeddings: Mistral-7B v0.2 / v0.3, Nemo).
enum class Architecture { kLlama, kQwen2, kMistral };

// transformers' names: "LlamaForCausalLM" / "llama", ...
const char* ArchitectureName(Architecture a);
const char* ModelTypeName(Architecture a);

enum class RopeType {
  kDefault,  // inv_freq[i] = theta^(-2i/d)
  kLinear,   // positions divided by `factor` (same as inv_freq / factor)
  kLlama3,   // Llama-3.1 frequency-dependent scaling (factor, low/high_freq_factor, original_max)
};

struct RopeConfig {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;
  double low_freq_factor = 1.0;   // llama3 only
  double high_freq_factor = 4.0;  // llama3 only
  int64_t original_max_position_embeddings = 8192;  // llama3 only
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;  // == num_heads for MHA, 1 for MQA
  int64_t head_dim = 0;      // `head_dim` if given, else hidden_size / num_heads
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2: always; Llama: `attention_bias`
  bool o_bias = false;    // Llama `attention_bias` also biases o_proj
  bool mlp_bias = false;  // Llama `mlp_bias`
  std::vector<int64_t> eos_token_ids;  // `eos_token_id` (int or list); may be empty
  int64_t bos_token_id = -1;           // -1 when absent
  int64_t pad_token_id = -1;           // -1 when absent (config.json's pad_token_id: null or none)
  std::string torch_dtype;             // "bfloat16", "float16", "float32" or empty

  int64_t group_size() const { return num_heads / num_kv_heads; }  // query heads per KV head
};

// Parses config.json text. Returns InvalidArgument naming the offending field for missing or
// inconsistent values (e.g. num_heads not divisible by num_kv_heads) and unsupported features.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text);

// Reads and parses `path`. NotFound if the file does not exist.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// Serialises to config.json in the classic form (rope_theta + rope_scaling), which transformers
// 4.x and 5.x both read. Used by `fluxion make-model`.
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_CONFIG_H_
