#include "cluster/router_validation.h"

#include <string>

#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

TEST(RouterValidationTest, ChecksIdPromptAndProtocolVersion) {
  fluxion::v1::GenerateRequest r;
  r.set_request_id("a");
  r.add_prompt_token_ids(7);
  EXPECT_TRUE(ValidateRouterRequest(r).ok());
  r.set_protocol_version(2);
  EXPECT_EQ(ValidateRouterRequest(r).code(), absl::StatusCode::kFailedPrecondition);
  r.set_protocol_version(1);
  r.clear_prompt_token_ids();
  EXPECT_EQ(ValidateRouterRequest(r).code(), absl::StatusCode::kInvalidArgument);
  r.add_prompt_token_ids(7);
  r.set_request_id(std::string(129, 'x'));
  EXPECT_EQ(ValidateRouterRequest(r).code(), absl::StatusCode::kInvalidArgument);
  r.clear_request_id();
  EXPECT_EQ(ValidateRouterRequest(r).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fluxion::cluster
