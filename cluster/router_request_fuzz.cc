// libFuzzer target: GenerateRequest protobuf bytes -> ParseFromArray -> the router's
// ValidateRouterRequest (cluster/router_validation.h). docs/FUZZING.md.
#include <cstddef>
#include <cstdint>

#include "cluster/router_validation.h"
#include "fluxion/v1/decode.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fluxion::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  const absl::Status valid = fluxion::cluster::ValidateRouterRequest(request);
  if (valid.ok() && (request.request_id().empty() || request.prompt_token_ids_size() == 0)) {
    __builtin_trap();
  }
  return 0;
}
