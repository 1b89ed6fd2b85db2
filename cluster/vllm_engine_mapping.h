// vllm.grpc.engine (SMG's engine protocol) <-> fluxion.v1, as pure functions so that the mapping
// is unit-tested apart from the service (cluster/vllm_engine_service.h). docs/PROTOCOL.md,
// "VllmEngine", is the table these implement.
//
// Thread-safe: pure functions.
#ifndef FLUXION_CLUSTER_VLLM_ENGINE_MAPPING_H_
#define FLUXION_CLUSTER_VLLM_ENGINE_MAPPING_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fluxion/v1/decode.pb.h"
#include "vllm/grpc/engine/vllm_engine.pb.h"

namespace fluxion::cluster {

// INVALID_ARGUMENT naming every field of `request` that is set to a value Fluxion cannot honour
// (penalties, logprobs, constraints, multimodal inputs, KV-transfer parameters, n > 1, ...), or
// when it has no input; stop strings are the service's (they need the tokenizer); OK otherwise.
// Values that mean "default" in vLLM's servicer (repetition_penalty 0 or 1, n 0 or 1,
// data_parallel_rank 0) are accepted, so SMG's requests, which always set them, pass.
absl::Status ValidateVllmRequest(const vllm::grpc::engine::GenerateRequest& request);

// The fluxion.v1 request for a validated `request` whose prompt is `prompt_ids` (its tokenized
// input, or its text tokenized by the caller).
v1::GenerateRequest ToFluxionRequest(const vllm::grpc::engine::GenerateRequest& request,
                                     const std::vector<uint32_t>& prompt_ids);


// Appends the first `tokens` of `chunk`'s generated tokens' logprobs to `out` (vLLM's parallel
// lists: the token's value and id, its alternatives).
void AppendOutputLogprobs(const v1::GenerateChunk& chunk, int tokens,
                          vllm::grpc::engine::OutputLogProbs* out);
// The prompt's logprobs in vLLM's shape: every prompt token, the first without a value.
vllm::grpc::engine::InputLogProbs ToVllmInputLogprobs(
    const google::protobuf::RepeatedField<uint32_t>& prompt, const v1::GenerateChunk& chunk);

// The terminal message for a fluxion.v1 `complete`. `output_ids`: what the message carries (every
// id when not streaming, the last chunk's when streaming, as vLLM's servicer does).
vllm::grpc::engine::GenerateComplete ToVllmComplete(const v1::GenerateComplete& complete,
                                                    uint32_t prompt_tokens,
                                                    const std::vector<uint32_t>& output_ids);

// GetLoads for the router's summed DecodeLoad: one rank (0). Requests being prefilled count as
// waiting; token counts are KV pages converted to tokens of one sequence (pages / (layers *
// kv_heads) * page_tokens); token_usage is kv_usage. `now` stamps the reply.
vllm::grpc::engine::GetLoadsResponse ToVllmLoads(const v1::DecodeLoad& load, absl::Time now);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_VLLM_ENGINE_MAPPING_H_
