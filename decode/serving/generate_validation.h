// Validation of a fluxion.v1 GenerateRequest, apart from the decode service so that it is a pure
// function of the request and the node's limits: unit-testable and fuzzed
// (decode/serving/generate_request_fuzz.cc, docs/FUZZING.md) without a model, an arena or a
// transport.
//
// Thread-safe: pure functions.
#ifndef FLUXION_DECODE_SERVING_GENERATE_VALIDATION_H_
#define FLUXION_DECODE_SERVING_GENERATE_VALIDATION_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "decode/sparse/policy.h"
#include "fluxion/v1/decode.pb.h"
#include "model/sampler.h"

namespace fluxion::decode {

// What the node accepts: from its model config and its command-line defaults.
struct GenerateLimits {
  int64_t vocab_size = 0;     // prompt and stop ids must be < vocab_size
  int64_t context_limit = 0;  // the model's max_position_embeddings; 0 = unbounded
  std::string default_policy;  // used when the request names none
  double default_budget = 0;
};

// The request's settings, checked and resolved against the limits.
struct ValidatedGenerate {
  model::SamplingParams sampling;
  int64_t max_tokens = 0;  // sampling.max_tokens, or what is left of the context
  int64_t context_limit = 0;  // GenerateLimits::context_limit: where decoding stops at the latest
  std::string policy_name;
  sparse::PolicyConfig policy;  // fluxion_predictor and host_cost are left for the caller
};

// INVALID_ARGUMENT naming the field for anything a client can get wrong (request_id, prompt ids,
// context, sampling, stop ids, sparse policy and budget); FAILED_PRECONDITION for a
// protocol_version newer than this server's.
absl::StatusOr<ValidatedGenerate> ValidateGenerateRequest(const fluxion::v1::GenerateRequest& request,
                                                          const GenerateLimits& limits);

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_SERVING_GENERATE_VALIDATION_H_
