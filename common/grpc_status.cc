#include "common/grpc_status.h"

#include <string>

namespace fluxion {
namespace {

// The conversions below are plain casts, which is only right while every canonical code has the
// same number in both libraries. Both follow google.rpc.Code, but a mismatch would silently turn
// one error into another across every RPC, so it is checked here rather than assumed.
#define FLUXION_CHECK_SAME_CODE(absl_code, grpc_code)              \
  static_assert(static_cast<int>(absl::StatusCode::absl_code) ==   \
                    static_cast<int>(grpc::StatusCode::grpc_code), \
                "absl::StatusCode::" #absl_code " != grpc::StatusCode::" #grpc_code)
FLUXION_CHECK_SAME_CODE(kOk, OK);
FLUXION_CHECK_SAME_CODE(kCancelled, CANCELLED);
FLUXION_CHECK_SAME_CODE(kUnknown, UNKNOWN);
FLUXION_CHECK_SAME_CODE(kInvalidArgument, INVALID_ARGUMENT);
FLUXION_CHECK_SAME_CODE(kDeadlineExceeded, DEADLINE_EXCEEDED);
FLUXION_CHECK_SAME_CODE(kNotFound, NOT_FOUND);
FLUXION_CHECK_SAME_CODE(kAlreadyExists, ALREADY_EXISTS);
FLUXION_CHECK_SAME_CODE(kPermissionDenied, PERMISSION_DENIED);
FLUXION_CHECK_SAME_CODE(kResourceExhausted, RESOURCE_EXHAUSTED);
FLUXION_CHECK_SAME_CODE(kFailedPrecondition, FAILED_PRECONDITION);
FLUXION_CHECK_SAME_CODE(kAborted, ABORTED);
FLUXION_CHECK_SAME_CODE(kOutOfRange, OUT_OF_RANGE);
FLUXION_CHECK_SAME_CODE(kUnimplemented, UNIMPLEMENTED);
FLUXION_CHECK_SAME_CODE(kInternal, INTERNAL);
FLUXION_CHECK_SAME_CODE(kUnavailable, UNAVAILABLE);
FLUXION_CHECK_SAME_CODE(kDataLoss, DATA_LOSS);
FLUXION_CHECK_SAME_CODE(kUnauthenticated, UNAUTHENTICATED);
#undef FLUXION_CHECK_SAME_CODE

constexpr int kLastCanonicalCode = static_cast<int>(absl::StatusCode::kUnauthenticated);

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::Status::code() is always canonical (non-canonical raw codes read as kUnknown).
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  if (code < 0 || code > kLastCanonicalCode) {
    return absl::UnknownError("non-canonical gRPC status code " + std::to_string(code) + ": " +
                              status.error_message());
  }
  return absl::Status(static_cast<absl::StatusCode>(code), status.error_message());
}

}  // namespace fluxion
