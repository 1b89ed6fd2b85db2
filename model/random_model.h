// Random-weight models in Hugging Face layout (config.json + model.safetensors, bf16), for tests,
// benchmarks and the demo. Weights are scaled so activations keep unit variance through the layers
// and the next-token distribution is far from flat (greedy decoding then has clear winners).
#ifndef FLUXION_MODEL_RANDOM_MODEL_H_
#define FLUXION_MODEL_RANDOM_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/config.h"

namespace fluxion::model {

// Names accepted by PresetConfig: "tiny" (Llama, 4 layers, GQA 8:2, llama3 RoPE; ~1M params) and
// "qwen2.5-0.5b" (Qwen2.5-0.5B shapes: 24 layers, 14:2 heads, tied embeddings; ~0.5B params).
std::vector<std::string> PresetNames();

// InvalidArgument listing the known presets for an unknown name.
absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset);

// Writes `dir/config.json` and `dir/model.safetensors` (bf16) for `config`, creating `dir`.
absl::Status WriteRandomModel(const ModelConfig& config, uint64_t seed, const std::string& dir);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_RANDOM_MODEL_H_
