// A model directory's generation_config.json: the sampling defaults its authors ship
// (transformers' GenerationConfig), which vLLM applies to requests that leave a field unset
// (`--generation-config auto`) and so does the router's OpenAI API (docs/PROTOCOL.md).
//
// Thread-safe: pure functions.
#ifndef FLUXION_MODEL_GENERATION_CONFIG_H_
#define FLUXION_MODEL_GENERATION_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fluxion::model {

// The fields that change how a request samples. Absent fields stay unset. `do_sample: false`
// (greedy decoding by default) reads as temperature 0, as transformers decodes.
struct GenerationDefaults {
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<uint32_t> top_k;
  // The default repetition penalty (model/logit_penalties.h) when the file sets one other than 1.
  std::optional<float> repetition_penalty;
  // `eos_token_id` (an id or a list): tokens that end a generation, which transformers and vLLM
  // add to config.json's (Llama 3 Instruct lists <|eot_id|> here).
  std::vector<int64_t> eos_token_ids;
};

// Parses the file's text. InvalidArgument naming the field for a value of the wrong type or out
// of range (temperature < 0, top_p outside (0, 1], top_k < 0); other fields are ignored.
absl::StatusOr<GenerationDefaults> ParseGenerationConfig(absl::string_view text);

// `<model_dir>/generation_config.json`, bounded like config.json; a missing file gives no
// defaults. Errors name the path.
absl::StatusOr<GenerationDefaults> LoadGenerationConfig(const std::string& model_dir);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_GENERATION_CONFIG_H_
