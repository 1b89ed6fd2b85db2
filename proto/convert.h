// Conversions the services share between fluxion.v1 messages and what the code uses: the
// transfer seam's CompatibilityRecord, the layout a model directory serves, sampling parameters. Used by
// prefill/ and decode/ only (they meet through proto/ and transfer/, never each other).
//
// Thread-safe: pure functions (ModelFingerprint reads files).
#ifndef FLUXION_PROTO_CONVERT_H_
#define FLUXION_PROTO_CONVERT_H_

#include <string>

#include "absl/status/statusor.h"
#include "fluxion/v1/common.pb.h"
#include "model/config.h"
#include "model/logprobs.h"
#include "model/sampler.h"
#include "transfer/transport.h"

namespace fluxion::proto {

// Identifies the weights in `model_dir`: "crc32c-" + hex CRC-32C over config.json and, per
// *.safetensors file in name order, its name, size and first MiB. Cheap at start-up for any model
// size; two nodes started from copies of one directory agree. NotFound without config.json.
absl::StatusOr<std::string> ModelFingerprint(const std::string& model_dir);

// The layout a node serving `config` with bf16 pages of `page_tokens` tokens advertises.
fluxion::v1::ModelLayout LayoutFor(const model::ModelConfig& config, const std::string& model_id,
                                   const std::string& model_hash, int64_t page_tokens);

// The fields two nodes must agree on, for transfer::CheckCompatible (model_hash is the model_id
// compared there; model_id on the wire is informational).
transfer::CompatibilityRecord CompatibilityOf(const fluxion::v1::ModelLayout& layout,
                                              uint32_t protocol_version);

// SamplingParams with the wire's defaults applied (absent temperature: 1.0; absent top_p: 1.0;
// absent seed: a random one). InvalidArgument naming the field for a negative or non-finite
// temperature, top_p outside (0, 1].
absl::StatusOr<model::SamplingParams> SamplingFromProto(const fluxion::v1::SamplingParams& p);

// The most prompt tokens x (prompt_logprobs + 1) a request may ask for: what keeps the prefill
// reply and the first chunk under gRPC's default 4 MiB message (about 12 bytes an entry).
inline constexpr int64_t kMaxPromptLogprobEntries = 131072;
// InvalidArgument naming the field when `p` asks for prompt logprobs beyond kMaxTopLogprobs, or
// for more than kMaxPromptLogprobEntries over `prompt_tokens` tokens.
absl::Status ValidatePromptLogprobs(const fluxion::v1::SamplingParams& p, int64_t prompt_tokens);

void TokenLogprobsToProto(const model::TokenLogprobs& l, fluxion::v1::TokenLogprobs* out);

}  // namespace fluxion::proto

#endif  // FLUXION_PROTO_CONVERT_H_
