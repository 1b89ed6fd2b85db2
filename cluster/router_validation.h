// Validation of a GenerateRequest at the router, apart from the relaying service so that it is a
// pure function: unit-testable and fuzzed (cluster/router_request_fuzz.cc, docs/FUZZING.md). The
// router checks only what it needs to route; the decode node checks the rest
// (decode/serving/generate_validation.h) against its model.
//
// Thread-safe: a pure function.
#ifndef FLUXION_CLUSTER_ROUTER_VALIDATION_H_
#define FLUXION_CLUSTER_ROUTER_VALIDATION_H_

#include "absl/status/status.h"
#include "fluxion/v1/decode.pb.h"

namespace fluxion::cluster {

// INVALID_ARGUMENT for a request_id outside 1..128 bytes or an empty prompt; FAILED_PRECONDITION
// for a protocol_version above the router's.
absl::Status ValidateRouterRequest(const fluxion::v1::GenerateRequest& request);

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_ROUTER_VALIDATION_H_
