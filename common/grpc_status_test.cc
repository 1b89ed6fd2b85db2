#include "common/grpc_status.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion {
namespace {

using ::testing::HasSubstr;

// Every canonical code except OK, which carries no message.
std::vector<absl::StatusCode> ErrorCodes() {
  return {absl::StatusCode::kCancelled,          absl::StatusCode::kUnknown,
          absl::StatusCode::kInvalidArgument,    absl::StatusCode::kDeadlineExceeded,
          absl::StatusCode::kNotFound,           absl::StatusCode::kAlreadyExists,
          absl::StatusCode::kPermissionDenied,   absl::StatusCode::kResourceExhausted,
          absl::StatusCode::kFailedPrecondition, absl::StatusCode::kAborted,
          absl::StatusCode::kOutOfRange,         absl::StatusCode::kUnimplemented,
          absl::StatusCode::kInternal,           absl::StatusCode::kUnavailable,
          absl::StatusCode::kDataLoss,           absl::StatusCode::kUnauthenticated};
}

TEST(GrpcStatusTest, OkMapsToOkBothWays) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(GrpcStatusTest, EveryErrorCodeKeepsItsNumberAndMessageToGrpc) {
  for (absl::StatusCode code : ErrorCodes()) {
    const grpc::Status converted = ToGrpcStatus(absl::Status(code, "page pool full"));
    EXPECT_EQ(static_cast<int>(converted.error_code()), static_cast<int>(code))
        << absl::StatusCodeToString(code);
    EXPECT_EQ(converted.error_message(), "page pool full");
  }
}

TEST(GrpcStatusTest, EveryErrorCodeRoundTripsUnchanged) {
  for (absl::StatusCode code : ErrorCodes()) {
    const absl::Status original(code, "request r-17: peer 10.0.0.7 unreachable");
    EXPECT_EQ(FromGrpcStatus(ToGrpcStatus(original)), original) << absl::StatusCodeToString(code);
  }
}

TEST(GrpcStatusTest, NamedCodesUsedByTheServicesMapToTheirGrpcNames) {
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::FailedPreconditionError("")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "late")),
            absl::DeadlineExceededError("late"));
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining")),
            absl::UnavailableError("draining"));
}

TEST(GrpcStatusTest, NonCanonicalGrpcCodeBecomesUnknownNamingTheNumber) {
  const absl::Status converted =
      FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(42), "odd peer"));
  EXPECT_EQ(converted.code(), absl::StatusCode::kUnknown);
  EXPECT_THAT(converted.message(), HasSubstr("42"));
  EXPECT_THAT(converted.message(), HasSubstr("odd peer"));
}

}  // namespace
}  // namespace fluxion
