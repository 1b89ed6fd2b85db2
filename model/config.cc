#include "model/config.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <initializer_list>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/json_text.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

absl::Status FieldError(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: '", field, "' ", problem));
}

absl::StatusOr<Json> ParseJson(absl::string_view text) {
  return ParseJsonText(text, "config.json", {kMaxJsonDepth, false});
}

// Typed, non-throwing access to the fields of one JSON object. `prefix` is prepended to field
// names in errors ("rope_scaling." for the nested object). Absent and null fields both read as
// "not given", as transformers treats them (`head_dim: null` means "derive it").
class Fields {
 public:
  Fields(const Json& object, std::string prefix) : object_(object), prefix_(std::move(prefix)) {}

  std::string Name(absl::string_view key) const { return absl::StrCat(prefix_, key); }

  const Json* Get(const std::string& key) const {
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool Has(const std::string& key) const { return Get(key) != nullptr; }

  absl::StatusOr<std::optional<int64_t>> OptionalInt(const std::string& key) const {
    const Json* value = Get(key);
    if (value == nullptr) return std::optional<int64_t>();
    return ToInt(*value, Name(key));
  }
  absl::StatusOr<int64_t> Int(const std::string& key, int64_t default_value) const {
    FLUXION_ASSIGN_OR_RETURN(std::optional<int64_t> value, OptionalInt(key));
    return value.value_or(default_value);
  }
  absl::StatusOr<int64_t> RequiredInt(const std::string& key) const {
    FLUXION_ASSIGN_OR_RETURN(std::optional<int64_t> value, OptionalInt(key));
    if (!value.has_value()) return FieldError(Name(key), "is required");
    return *value;
  }

  absl::StatusOr<std::optional<double>> OptionalNumber(const std::string& key) const {
    const Json* value = Get(key);
    if (value == nullptr) return std::optional<double>();
    if (!value->is_number()) {
      return FieldError(Name(key), absl::StrCat("must be a number, got ", value->type_name()));
    }
    return std::optional<double>(value->get<double>());
  }
  absl::StatusOr<double> Number(const std::string& key, double default_value) const {
    FLUXION_ASSIGN_OR_RETURN(std::optional<double> value, OptionalNumber(key));
    return value.value_or(default_value);
  }
  absl::StatusOr<double> RequiredNumber(const std::string& key, absl::string_view why) const {
    FLUXION_ASSIGN_OR_RETURN(std::optional<double> value, OptionalNumber(key));
    if (!value.has_value()) return FieldError(Name(key), absl::StrCat("is required ", why));
    return *value;
  }

  absl::StatusOr<bool> Bool(const std::string& key, bool default_value) const {
    const Json* value = Get(key);
    if (value == nullptr) return default_value;
    if (!value->is_boolean()) {
      return FieldError(Name(key), absl::StrCat("must be true or false, got ", value->type_name()));
    }
    return value->get<bool>();
  }

  absl::StatusOr<std::optional<std::string>> OptionalString(const std::string& key) const {
    const Json* value = Get(key);
    if (value == nullptr) return std::optional<std::string>();
    if (!value->is_string()) {
      return FieldError(Name(key), absl::StrCat("must be a string, got ", value->type_name()));
    }
    return std::optional<std::string>(value->get_ref<const std::string&>());
  }

  static absl::StatusOr<int64_t> ToInt(const Json& value, const std::string& name) {
    // Python's json module writes ints without a fraction, so 4096.0 is a mistake, not a size.
    if (!value.is_number_integer()) {
      return FieldError(name, absl::StrCat("must be an integer, got ", value.type_name()));
    }
    if (value.is_number_unsigned() &&
        value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(name, "is out of range");
    }
    return value.get<int64_t>();
  }

 private:
  const Json& object_;
  std::string prefix_;
};

absl::Status RequirePositive(absl::string_view field, int64_t value) {
  if (value <= 0) return FieldError(field, absl::StrCat("must be positive, got ", value));
  return absl::OkStatus();
}

// 1 <= value <= limit; the limits and their reasons are in config.h.
absl::Status RequireInRange(absl::string_view field, int64_t value, int64_t limit) {
  FLUXION_RETURN_IF_ERROR(RequirePositive(field, value));
  if (value > limit) {
    return FieldError(field, absl::StrCat("is ", value, ", above the limit of ", limit));
  }
  return absl::OkStatus();
}

// NaN and infinities pass comparisons like `x > 0` in surprising ways; every real number in a
// config is finite.
absl::Status RequireFinitePositive(absl::string_view field, double value) {
  if (!std::isfinite(value) || !(value > 0)) {
    return FieldError(field, absl::StrCat("must be a finite positive number, got ", value));
  }
  return absl::OkStatus();
}

// `product` = a * b * c...; InvalidArgument naming `what` if it overflows int64 or exceeds
// `limit`. With the per-field limits no product overflows today; the check keeps that true if a
// limit is raised.
absl::Status CheckProduct(absl::string_view what, std::initializer_list<int64_t> factors,
                          int64_t limit) {
  int64_t product = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(product, f, &product) || product > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: ", what, " exceeds the limit of ", limit));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Architecture> ArchitectureFromName(absl::string_view field, absl::string_view name) {
  for (Architecture a : {Architecture::kLlama, Architecture::kQwen2, Architecture::kMistral}) {
    if (name == ArchitectureName(a) || name == ModelTypeName(a)) return a;
  }
  return FieldError(field, absl::StrCat("names unsupported architecture '", name,
                                        "' (supported: LlamaForCausalLM / llama, "
                                        "Qwen2ForCausalLM / qwen2, MistralForCausalLM / mistral)"));
}

absl::StatusOr<Architecture> ReadArchitecture(const Fields& fields) {
  std::optional<Architecture> from_architectures;
  if (const Json* list = fields.Get("architectures")) {
    if (!list->is_array() || list->empty() || !(*list)[0].is_string()) {
      return FieldError("architectures", "must be a non-empty list of strings");
    }
    FLUXION_ASSIGN_OR_RETURN(
        from_architectures,
        ArchitectureFromName("architectures[0]", (*list)[0].get_ref<const std::string&>()));
  }
  FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> model_type,
                           fields.OptionalString("model_type"));
  std::optional<Architecture> from_model_type;
  if (model_type.has_value()) {
    FLUXION_ASSIGN_OR_RETURN(from_model_type, ArchitectureFromName("model_type", *model_type));
  }
  if (from_architectures.has_value() && from_model_type.has_value() &&
      *from_architectures != *from_model_type) {
    return FieldError("model_type",
                      absl::StrCat("('", *model_type, "') disagrees with 'architectures[0]'"));
  }
  if (from_architectures.has_value()) return *from_architectures;
  if (from_model_type.has_value()) return *from_model_type;
  return FieldError("architectures", "is required (or 'model_type')");
}

// Reads the scaling fields of `rope_type` from `scaling` (the rope_scaling or rope_parameters
// object) into `rope`.
absl::Status ReadRopeScaling(const Fields& scaling, const std::string& rope_type,
                             RopeConfig* rope) {
  if (rope_type == "default") {
    rope->type = RopeType::kDefault;
    return absl::OkStatus();
  }
  if (rope_type == "linear") {
    rope->type = RopeType::kLinear;
    FLUXION_ASSIGN_OR_RETURN(rope->factor,
                             scaling.RequiredNumber("factor", "for rope_type 'linear'"));
    return RequireFinitePositive(scaling.Name("factor"), rope->factor);
  }
  if (rope_type == "llama3") {
    // transformers indexes all four fields unconditionally for llama3, so a missing one is an
    // incomplete config, not a request for a default.
    const char* why = "for rope_type 'llama3'";
    rope->type = RopeType::kLlama3;
    FLUXION_ASSIGN_OR_RETURN(rope->factor, scaling.RequiredNumber("factor", why));
    FLUXION_ASSIGN_OR_RETURN(rope->low_freq_factor, scaling.RequiredNumber("low_freq_factor", why));
    FLUXION_ASSIGN_OR_RETURN(rope->high_freq_factor,
                             scaling.RequiredNumber("high_freq_factor", why));
    FLUXION_ASSIGN_OR_RETURN(std::optional<int64_t> original,
                             scaling.OptionalInt("original_max_position_embeddings"));
    if (!original.has_value()) {
      return FieldError(scaling.Name("original_max_position_embeddings"),
                        absl::StrCat("is required ", why));
    }
    rope->original_max_position_embeddings = *original;
    FLUXION_RETURN_IF_ERROR(RequireFinitePositive(scaling.Name("factor"), rope->factor));
    FLUXION_RETURN_IF_ERROR(
        RequireFinitePositive(scaling.Name("low_freq_factor"), rope->low_freq_factor));
    FLUXION_RETURN_IF_ERROR(
        RequireFinitePositive(scaling.Name("high_freq_factor"), rope->high_freq_factor));
    // The smoothing between the two cut-offs divides by (high - low).
    if (!(rope->high_freq_factor > rope->low_freq_factor)) {
      return FieldError(scaling.Name("high_freq_factor"), "must be greater than low_freq_factor");
    }
    return RequireInRange(scaling.Name("original_max_position_embeddings"),
                          rope->original_max_position_embeddings, kMaxPositionEmbeddings);
  }
  // dynamic, yarn, longrope, su, mrope, ...: each changes the math in its own way.
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: '", scaling.Name("rope_type"), "': rope_scaling type '", rope_type,
                   "' is not supported (supported: default, linear, llama3)"));
}

// The rope type named in a scaling object: "rope_type", or the pre-4.42 key "type".
absl::StatusOr<std::optional<std::string>> RopeTypeOf(const Fields& scaling) {
  FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> type, scaling.OptionalString("rope_type"));
  if (type.has_value()) return type;
  return scaling.OptionalString("type");
}

absl::StatusOr<RopeConfig> ReadRope(const Fields& fields) {
  RopeConfig rope;
  FLUXION_ASSIGN_OR_RETURN(rope.theta, fields.Number("rope_theta", rope.theta));
  // transformers 5 folds rope_theta and the scaling into one object; when both forms are present
  // it reads rope_parameters, and so do we.
  if (const Json* params = fields.Get("rope_parameters")) {
    if (!params->is_object()) {
      return FieldError("rope_parameters",
                        absl::StrCat("must be an object, got ", params->type_name()));
    }
    Fields scaling(*params, "rope_parameters.");
    FLUXION_ASSIGN_OR_RETURN(rope.theta, scaling.Number("rope_theta", rope.theta));
    FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> type, RopeTypeOf(scaling));
    FLUXION_RETURN_IF_ERROR(ReadRopeScaling(scaling, type.value_or("default"), &rope));
  } else if (const Json* classic = fields.Get("rope_scaling")) {
    if (!classic->is_object()) {
      return FieldError("rope_scaling",
                        absl::StrCat("must be an object or null, got ", classic->type_name()));
    }
    Fields scaling(*classic, "rope_scaling.");
    FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> type, RopeTypeOf(scaling));
    if (!type.has_value()) return FieldError("rope_scaling.rope_type", "is required");
    FLUXION_RETURN_IF_ERROR(ReadRopeScaling(scaling, *type, &rope));
  }
  FLUXION_RETURN_IF_ERROR(RequireFinitePositive("rope_theta", rope.theta));
  return rope;
}

absl::StatusOr<std::vector<int64_t>> ReadTokenIds(const Fields& fields, const std::string& key) {
  std::vector<int64_t> ids;
  const Json* value = fields.Get(key);
  if (value == nullptr) return ids;
  if (value->is_array()) {
    if (value->size() > static_cast<size_t>(kMaxTokenIds)) {
      return FieldError(key, absl::StrCat("lists ", value->size(), " ids, above the limit of ",
                                          kMaxTokenIds));
    }
    for (size_t i = 0; i < value->size(); ++i) {
      FLUXION_ASSIGN_OR_RETURN(int64_t id,
                               Fields::ToInt((*value)[i], absl::StrCat(key, "[", i, "]")));
      ids.push_back(id);
    }
  } else {
    FLUXION_ASSIGN_OR_RETURN(int64_t id, Fields::ToInt(*value, key));
    ids.push_back(id);
  }
  for (int64_t id : ids) {
    if (id < 0) return FieldError(key, absl::StrCat("must be non-negative, got ", id));
    // Token ids travel as uint32 on the wire and int32 in the samplers.
    if (id >= kMaxVocabSize) {
      return FieldError(key, absl::StrCat("holds ", id, ", above the limit of ", kMaxVocabSize));
    }
  }
  return ids;
}

// Qwen2 slides the window only on layers >= max_window_layers, but we refuse any window that is
// shorter than the context rather than depend on that default-laden rule: we only run full
// attention, and a window that never bites (>= max_position_embeddings) is full attention.
// Mistral has no use_sliding_window: its window applies whenever sliding_window is set.
absl::Status CheckSlidingWindow(const Fields& fields, const ModelConfig& config) {
  FLUXION_ASSIGN_OR_RETURN(
      bool use_sliding_window,
      fields.Bool("use_sliding_window", config.architecture == Architecture::kMistral));
  FLUXION_ASSIGN_OR_RETURN(std::optional<int64_t> window, fields.OptionalInt("sliding_window"));
  if (!use_sliding_window || !window.has_value()) return absl::OkStatus();
  if (*window < config.max_position_embeddings) {
    return FieldError(
        "use_sliding_window",
        absl::StrCat("is on with sliding_window ", *window, " < max_position_embeddings ",
                     config.max_position_embeddings, "; only full attention is supported"));
  }
  return absl::OkStatus();
}

absl::Status Validate(const ModelConfig& config, bool head_dim_given) {
  FLUXION_RETURN_IF_ERROR(RequireInRange("vocab_size", config.vocab_size, kMaxVocabSize));
  FLUXION_RETURN_IF_ERROR(RequireInRange("hidden_size", config.hidden_size, kMaxHiddenSize));
  FLUXION_RETURN_IF_ERROR(
      RequireInRange("intermediate_size", config.intermediate_size, kMaxIntermediateSize));
  FLUXION_RETURN_IF_ERROR(RequireInRange("num_hidden_layers", config.num_layers, kMaxLayers));
  FLUXION_RETURN_IF_ERROR(RequireInRange("num_attention_heads", config.num_heads, kMaxHeads));
  FLUXION_RETURN_IF_ERROR(RequireInRange("num_key_value_heads", config.num_kv_heads, kMaxHeads));
  FLUXION_RETURN_IF_ERROR(RequireInRange("max_position_embeddings",
                                         config.max_position_embeddings, kMaxPositionEmbeddings));
  if (config.num_heads % config.num_kv_heads != 0) {
    return FieldError("num_key_value_heads",
                      absl::StrCat("(", config.num_kv_heads, ") must divide num_attention_heads (",
                                   config.num_heads, ")"));
  }
  if (!head_dim_given && config.hidden_size % config.num_heads != 0) {
    return FieldError("hidden_size", absl::StrCat("(", config.hidden_size,
                                                  ") is not divisible by num_attention_heads (",
                                                  config.num_heads, ") and no head_dim is given"));
  }
  FLUXION_RETURN_IF_ERROR(RequireInRange("head_dim", config.head_dim, kMaxHeadDim));
  // RoPE rotates pairs of dimensions.
  if (config.head_dim % 2 != 0) {
    return FieldError("head_dim", absl::StrCat("must be even for RoPE, got ", config.head_dim));
  }
  if (!std::isfinite(config.rms_norm_eps) || !(config.rms_norm_eps > 0)) {
    return FieldError("rms_norm_eps", "must be a finite positive number");
  }
  // The sizes the model forms from the fields: projection widths, weight matrices, and the KV
  // cache of one position across all layers. Each must be a valid element count of one buffer.
  constexpr int64_t kMaxElements = int64_t{1} << 40;
  FLUXION_RETURN_IF_ERROR(CheckProduct("num_attention_heads * head_dim",
                                       {config.num_heads, config.head_dim}, kMaxElements));
  FLUXION_RETURN_IF_ERROR(CheckProduct("num_attention_heads * head_dim * hidden_size",
                                       {config.num_heads, config.head_dim, config.hidden_size},
                                       kMaxElements));
  FLUXION_RETURN_IF_ERROR(CheckProduct("vocab_size * hidden_size",
                                       {config.vocab_size, config.hidden_size}, kMaxElements));
  FLUXION_RETURN_IF_ERROR(CheckProduct("intermediate_size * hidden_size",
                                       {config.intermediate_size, config.hidden_size},
                                       kMaxElements));
  FLUXION_RETURN_IF_ERROR(CheckProduct(
      "num_hidden_layers * num_key_value_heads * head_dim * max_position_embeddings",
      {config.num_layers, config.num_kv_heads, config.head_dim, config.max_position_embeddings},
      std::numeric_limits<int64_t>::max() / 8));
  if (config.bos_token_id >= config.vocab_size) {
    return FieldError("bos_token_id", absl::StrCat("(", config.bos_token_id,
                                                   ") is outside the vocabulary [0, ",
                                                   config.vocab_size, ")"));
  }
  if (config.pad_token_id >= config.vocab_size) {
    return FieldError("pad_token_id", absl::StrCat("(", config.pad_token_id,
                                                   ") is outside the vocabulary [0, ",
                                                   config.vocab_size, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
    return absl::ErrnoToStatus(errno, absl::StrCat("opening ", path));
  }
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      close(fd);
      return absl::ErrnoToStatus(error, absl::StrCat("reading ", path));
    }
    if (n == 0) break;
    // Checked while reading, not from fstat, so a growing file or a pipe is bounded too.
    if (contents.size() + static_cast<size_t>(n) > kMaxConfigBytes) {
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, " is larger than the limit of ",
                                                     kMaxConfigBytes, " bytes for config.json"));
    }
    contents.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return contents;
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text) {
  if (json_text.size() > kMaxConfigBytes) {
    return absl::InvalidArgumentError(absl::StrCat("config.json of ", json_text.size(),
                                                   " bytes is above the limit of ",
                                                   kMaxConfigBytes));
  }
  FLUXION_ASSIGN_OR_RETURN(Json root, ParseJson(json_text));
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json must be a JSON object, got ", root.type_name()));
  }
  const Fields fields(root, "");
  ModelConfig config;
  FLUXION_ASSIGN_OR_RETURN(config.architecture, ReadArchitecture(fields));
  const bool mistral = config.architecture == Architecture::kMistral;
  const bool llama = config.architecture == Architecture::kLlama || mistral;

  FLUXION_ASSIGN_OR_RETURN(config.vocab_size, fields.RequiredInt("vocab_size"));
  FLUXION_ASSIGN_OR_RETURN(config.hidden_size, fields.RequiredInt("hidden_size"));
  FLUXION_ASSIGN_OR_RETURN(config.intermediate_size, fields.RequiredInt("intermediate_size"));
  FLUXION_ASSIGN_OR_RETURN(config.num_layers, fields.RequiredInt("num_hidden_layers"));
  FLUXION_ASSIGN_OR_RETURN(config.num_heads, fields.RequiredInt("num_attention_heads"));
  FLUXION_ASSIGN_OR_RETURN(config.num_kv_heads,
                           fields.Int("num_key_value_heads", config.num_heads));
  FLUXION_ASSIGN_OR_RETURN(std::optional<int64_t> head_dim, fields.OptionalInt("head_dim"));
  // A non-positive head count is reported by Validate below; do not divide by it here.
  config.head_dim =
      head_dim.value_or(config.num_heads > 0 ? config.hidden_size / config.num_heads : 0);
  FLUXION_ASSIGN_OR_RETURN(config.rms_norm_eps, fields.Number("rms_norm_eps", 1e-6));
  // The defaults transformers fills in when the field is absent.
  FLUXION_ASSIGN_OR_RETURN(config.max_position_embeddings,
                           fields.Int("max_position_embeddings",
                                      mistral ? 131072 : (llama ? 2048 : 32768)));
  FLUXION_ASSIGN_OR_RETURN(config.rope, ReadRope(fields));
  FLUXION_ASSIGN_OR_RETURN(config.tie_word_embeddings, fields.Bool("tie_word_embeddings", false));
  if (llama) {
    FLUXION_ASSIGN_OR_RETURN(config.qkv_bias, fields.Bool("attention_bias", false));
    config.o_bias = config.qkv_bias;
    FLUXION_ASSIGN_OR_RETURN(config.mlp_bias, fields.Bool("mlp_bias", false));
    if (mistral) FLUXION_RETURN_IF_ERROR(CheckSlidingWindow(fields, config));
  } else {
    // Qwen2's attention hard-codes bias=True on q/k/v and bias=False on o_proj and the MLP.
    config.qkv_bias = true;
    config.o_bias = false;
    config.mlp_bias = false;
    FLUXION_RETURN_IF_ERROR(CheckSlidingWindow(fields, config));
  }
  FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> hidden_act,
                           fields.OptionalString("hidden_act"));
  if (hidden_act.has_value() && *hidden_act != "silu") {
    return FieldError("hidden_act",
                      absl::StrCat("'", *hidden_act, "' is not supported (only silu)"));
  }
  FLUXION_ASSIGN_OR_RETURN(config.eos_token_ids, ReadTokenIds(fields, "eos_token_id"));
  FLUXION_ASSIGN_OR_RETURN(std::optional<int64_t> bos, fields.OptionalInt("bos_token_id"));
  if (bos.has_value() && *bos < 0) {
    return FieldError("bos_token_id", absl::StrCat("must be non-negative, got ", *bos));
  }
  config.bos_token_id = bos.value_or(-1);
  FLUXION_ASSIGN_OR_RETURN(std::optional<int64_t> pad, fields.OptionalInt("pad_token_id"));
  if (pad.has_value() && *pad < 0) {
    return FieldError("pad_token_id", absl::StrCat("must be non-negative, got ", *pad));
  }
  config.pad_token_id = pad.value_or(-1);
  // transformers 5 renamed torch_dtype to dtype.
  const char* dtype_key = fields.Has("dtype") ? "dtype" : "torch_dtype";
  FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> dtype, fields.OptionalString(dtype_key));
  config.torch_dtype = dtype.value_or("");
  if (!config.torch_dtype.empty() && config.torch_dtype != "bfloat16" &&
      config.torch_dtype != "float16" && config.torch_dtype != "float32") {
    return FieldError(dtype_key, absl::StrCat("'", config.torch_dtype,
                                              "' is not one of bfloat16, float16, float32"));
  }
  FLUXION_RETURN_IF_ERROR(Validate(config, head_dim.has_value()));
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  FLUXION_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(path, ": ", config.status().message()));
  }
  return config;
}

namespace {

struct ArchitectureNames {
  Architecture architecture;
  const char* name;
  const char* model_type;
};
constexpr ArchitectureNames kArchitectureNames[] = {
    {Architecture::kLlama, "LlamaForCausalLM", "llama"},
    {Architecture::kQwen2, "Qwen2ForCausalLM", "qwen2"},
    {Architecture::kMistral, "MistralForCausalLM", "mistral"},
};

const ArchitectureNames& NamesOf(Architecture a) {
  for (const ArchitectureNames& n : kArchitectureNames) {
    if (n.architecture == a) return n;
  }
  return kArchitectureNames[0];
}

}  // namespace

const char* ArchitectureName(Architecture a) { return NamesOf(a).name; }
const char* ModelTypeName(Architecture a) { return NamesOf(a).model_type; }

std::string ModelConfigToJson(const ModelConfig& config) {
  const bool llama = config.architecture != Architecture::kQwen2;
  OrderedJson out;
  out["architectures"] = OrderedJson::array({ArchitectureName(config.architecture)});
  out["model_type"] = ModelTypeName(config.architecture);
  out["vocab_size"] = config.vocab_size;
  out["hidden_size"] = config.hidden_size;
  out["intermediate_size"] = config.intermediate_size;
  out["num_hidden_layers"] = config.num_layers;
  out["num_attention_heads"] = config.num_heads;
  out["num_key_value_heads"] = config.num_kv_heads;
  out["head_dim"] = config.head_dim;
  out["hidden_act"] = "silu";
  out["rms_norm_eps"] = config.rms_norm_eps;
  out["max_position_embeddings"] = config.max_position_embeddings;
  out["rope_theta"] = config.rope.theta;
  switch (config.rope.type) {
    case RopeType::kDefault:
      out["rope_scaling"] = nullptr;
      break;
    case RopeType::kLinear:
      out["rope_scaling"] = {{"rope_type", "linear"}, {"factor", config.rope.factor}};
      break;
    case RopeType::kLlama3:
      out["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", config.rope.factor},
          {"low_freq_factor", config.rope.low_freq_factor},
          {"high_freq_factor", config.rope.high_freq_factor},
          {"original_max_position_embeddings", config.rope.original_max_position_embeddings}};
      break;
  }
  out["tie_word_embeddings"] = config.tie_word_embeddings;
  if (llama) {
    // Llama has one switch for all four attention projections; qkv_bias is the one loaders need.
    out["attention_bias"] = config.qkv_bias;
    out["mlp_bias"] = config.mlp_bias;
    if (config.architecture == Architecture::kMistral) out["sliding_window"] = nullptr;
  } else {
    out["use_sliding_window"] = false;
  }
  if (config.bos_token_id >= 0) {
    out["bos_token_id"] = config.bos_token_id;
  } else {
    out["bos_token_id"] = nullptr;
  }
  if (config.pad_token_id >= 0) out["pad_token_id"] = config.pad_token_id;
  if (config.eos_token_ids.empty()) {
    out["eos_token_id"] = nullptr;
  } else if (config.eos_token_ids.size() == 1) {
    out["eos_token_id"] = config.eos_token_ids[0];
  } else {
    out["eos_token_id"] = config.eos_token_ids;
  }
  if (!config.torch_dtype.empty()) out["torch_dtype"] = config.torch_dtype;
  // `replace` keeps dump() from throwing on a torch_dtype that is not UTF-8.
  return out.dump(2, ' ', /*ensure_ascii=*/false, OrderedJson::error_handler_t::replace) + "\n";
}

}  // namespace fluxion::model
