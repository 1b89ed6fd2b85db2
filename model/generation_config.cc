#include "model/generation_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/json_text.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {
namespace {

using Json = nlohmann::json;

// generation_config.json files are a few hundred bytes; this bounds a hostile one.
constexpr size_t kMaxGenerationConfigBytes = 1 << 20;

absl::Status FieldError(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("generation_config.json: '", field, "' ", problem));
}

absl::StatusOr<std::optional<double>> Number(const Json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<double>();
  if (!it->is_number()) return FieldError(key, "must be a number");
  const double v = it->get<double>();
  if (!std::isfinite(v)) return FieldError(key, "must be finite");
  return std::optional<double>(v);
}

}  // namespace

absl::StatusOr<GenerationDefaults> ParseGenerationConfig(absl::string_view text) {
  FLUXION_ASSIGN_OR_RETURN(Json j, ParseJsonText(text, "generation_config.json", {64, false}));
  if (!j.is_object()) return absl::InvalidArgumentError("generation_config.json is not an object");
  GenerationDefaults d;
  FLUXION_ASSIGN_OR_RETURN(std::optional<double> temperature, Number(j, "temperature"));
  FLUXION_ASSIGN_OR_RETURN(std::optional<double> top_p, Number(j, "top_p"));
  FLUXION_ASSIGN_OR_RETURN(std::optional<double> top_k, Number(j, "top_k"));
  FLUXION_ASSIGN_OR_RETURN(std::optional<double> penalty, Number(j, "repetition_penalty"));
  if (temperature) {
    if (*temperature < 0) return FieldError("temperature", "must be >= 0");
    d.temperature = static_cast<float>(*temperature);
  }
  if (top_p) {
    if (!(*top_p > 0 && *top_p <= 1)) return FieldError("top_p", "must be in (0, 1]");
    d.top_p = static_cast<float>(*top_p);
  }
  if (top_k) {
    if (*top_k < 0 || *top_k > 1e9 || *top_k != static_cast<double>(static_cast<int64_t>(*top_k))) {
      return FieldError("top_k", "must be a whole number >= 0");
    }
    d.top_k = static_cast<uint32_t>(*top_k);
  }
  if (penalty) {
    if (!(*penalty > 0)) return FieldError("repetition_penalty", "must be > 0");
    if (*penalty != 1.0) d.repetition_penalty = static_cast<float>(*penalty);
  }
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    const Json ids = it->is_array() ? *it : Json::array({*it});
    if (ids.size() > 64) return FieldError("eos_token_id", "lists more than 64 ids");
    for (const Json& id : ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (1LL << 31)) {
        return FieldError("eos_token_id", "must be a token id or a list of them");
      }
      d.eos_token_ids.push_back(id.get<int64_t>());
    }
  }
  if (auto it = j.find("do_sample"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return FieldError("do_sample", "must be a boolean");
    if (!it->get<bool>()) d.temperature = 0.0f;  // greedy, as transformers decodes by default
  }
  return d;
}

absl::StatusOr<GenerationDefaults> LoadGenerationConfig(const std::string& model_dir) {
  const std::string path = model_dir + "/generation_config.json";
  absl::StatusOr<std::string> text = ReadFileBounded(path, kMaxGenerationConfigBytes);
  if (absl::IsNotFound(text.status())) return GenerationDefaults();
  if (!text.ok()) return text.status();
  absl::StatusOr<GenerationDefaults> parsed = ParseGenerationConfig(*text);
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(), absl::StrCat(path, ": ", parsed.status().message()));
  }
  return parsed;
}

}  // namespace fluxion::model
