// libFuzzer target: GenerateRequest protobuf bytes -> ParseFromArray -> the decode node's
// ValidateGenerateRequest (decode/serving/generate_validation.h) with a small model's limits. Any
// bytes must give a request that is rejected or a consistent accepted one. docs/FUZZING.md.
#include <cstddef>
#include <cstdint>

#include "decode/serving/generate_validation.h"
#include "fluxion/v1/decode.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fluxion::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  // The tiny preset's vocabulary and context, and the decode node's default policy.
  const fluxion::decode::GenerateLimits limits{512, 32768, "full", 0.0};
  absl::StatusOr<fluxion::decode::ValidatedGenerate> valid =
      fluxion::decode::ValidateGenerateRequest(request, limits);
  if (valid.ok()) {
    if (valid->max_tokens < 1) __builtin_trap();
    for (uint32_t id : request.prompt_token_ids()) {
      if (id >= limits.vocab_size) __builtin_trap();
    }
  }
  return 0;
}
