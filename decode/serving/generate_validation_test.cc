#include "decode/serving/generate_validation.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::decode {
namespace {

namespace v1 = ::fluxion::v1;
using ::testing::HasSubstr;

const GenerateLimits kLimits{512, 1024, "full", 0.0};

v1::GenerateRequest Valid() {
  v1::GenerateRequest r;
  r.set_request_id("r1");
  r.add_prompt_token_ids(1);
  r.add_prompt_token_ids(2);
  return r;
}

void ExpectRejected(const v1::GenerateRequest& r, absl::StatusCode code, const std::string& what) {
  absl::StatusOr<ValidatedGenerate> v = ValidateGenerateRequest(r, kLimits);
  ASSERT_FALSE(v.ok()) << what;
  EXPECT_EQ(v.status().code(), code) << v.status();
  EXPECT_THAT(std::string(v.status().message()), HasSubstr(what));
}

TEST(GenerateValidationTest, AcceptsAMinimalRequestAndFillsTheDefaults) {
  absl::StatusOr<ValidatedGenerate> v = ValidateGenerateRequest(Valid(), kLimits);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->max_tokens, 1024 - 2);  // what is left of the context
  EXPECT_EQ(v->policy_name, "full");
}

TEST(GenerateValidationTest, RejectsWhatAClientCanGetWrongNamingTheField) {
  v1::GenerateRequest r = Valid();
  r.set_request_id(std::string(129, 'x'));
  ExpectRejected(r, absl::StatusCode::kInvalidArgument, "request_id");
  r = Valid();
  r.clear_prompt_token_ids();
  ExpectRejected(r, absl::StatusCode::kInvalidArgument, "prompt_token_ids");
  r = Valid();
  r.add_prompt_token_ids(512);
  ExpectRejected(r, absl::StatusCode::kInvalidArgument, "prompt_token_ids[2]");
  r = Valid();
  for (int i = 0; i < 1100; ++i) r.add_prompt_token_ids(3);
  ExpectRejected(r, absl::StatusCode::kInvalidArgument,
                 "This model's maximum context length is 1024 tokens. However, your prompt "
                 "resulted in 1102 tokens.");
  r = Valid();
  r.mutable_sampling()->set_max_tokens(1023);
  ExpectRejected(r, absl::StatusCode::kInvalidArgument,
                 "This model's maximum context length is 1024 tokens. However, you requested "
                 "1025 tokens (2 in the prompt, 1023 in the completion).");
  r = Valid();
  r.mutable_sampling()->set_max_tokens(0);
  ExpectRejected(r, absl::StatusCode::kInvalidArgument, "max_tokens");
  r = Valid();
  r.mutable_sampling()->add_stop_token_ids(4096);
  ExpectRejected(r, absl::StatusCode::kInvalidArgument, "stop_token_ids");
  r = Valid();
  r.mutable_sparse()->set_policy("full");
  r.mutable_sparse()->set_budget(0.5f);
  ExpectRejected(r, absl::StatusCode::kInvalidArgument, "sparse.budget");
  r = Valid();
  r.mutable_sparse()->set_policy("no_such_policy");
  ExpectRejected(r, absl::StatusCode::kInvalidArgument, "sparse");
  r = Valid();
  r.set_protocol_version(2);
  ExpectRejected(r, absl::StatusCode::kFailedPrecondition, "protocol_version");
}

}  // namespace
}  // namespace fluxion::decode
