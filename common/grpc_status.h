// The one conversion point between absl::Status, which every part of Fluxion returns, and
// grpc::Status, which only the gRPC services and clients see. Service reactors call ToGrpcStatus
// once, in Finish(); clients call FromGrpcStatus once, on the status a call ends with.
//
// Why this is its own target (fluxion::grpc_status) rather than part of fluxion::common:
// fluxion::common is linked by kernels/ and model/, which must never depend on gRPC (DESIGN.md,
// "Parts and folders"). Only prefill/, decode/, cluster/ and tools/ link this one.
//
// Codes map 1:1 and keep their numbers: both libraries use the canonical codes of google.rpc.Code
// (grpc_status.cc checks this at compile time). Messages are kept verbatim. absl payloads and
// gRPC error_details are not carried: Fluxion puts everything a peer needs into the message or
// into proto fields (docs/PROTOCOL.md).
//
// Thread-safe: both functions are pure.
#ifndef FLUXION_COMMON_GRPC_STATUS_H_
#define FLUXION_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace fluxion {

// Returns a grpc::Status with the same code and message. OK maps to grpc::Status::OK.
grpc::Status ToGrpcStatus(const absl::Status& status);

// Returns an absl::Status with the same code and message. A code outside the canonical range
// (a misbehaving peer can send any integer) becomes kUnknown, with the original number named in
// the message so that it is not lost.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace fluxion

#endif  // FLUXION_COMMON_GRPC_STATUS_H_
