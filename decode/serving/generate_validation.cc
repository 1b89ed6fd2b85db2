#include "decode/serving/generate_validation.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/context_length.h"
#include "common/status_macros.h"
#include "proto/convert.h"

namespace fluxion::decode {

namespace v1 = ::fluxion::v1;

absl::StatusOr<ValidatedGenerate> ValidateGenerateRequest(const v1::GenerateRequest& request,
                                                          const GenerateLimits& limits) {
  const int64_t n = request.prompt_token_ids_size();
  const std::string& id = request.request_id();
  if (id.empty() || id.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id must be 1 to 128 bytes, got ", id.size()));
  }
  if (request.protocol_version() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "protocol_version ", request.protocol_version(), " is newer than this server's 1"));
  }
  if (n == 0) return absl::InvalidArgumentError("prompt_token_ids is empty");
  for (int64_t i = 0; i < n; ++i) {
    if (request.prompt_token_ids(i) >= static_cast<uint64_t>(limits.vocab_size)) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt_token_ids[", i, "] = ", request.prompt_token_ids(i),
                       " is outside the model's vocabulary [0, ", limits.vocab_size, ")"));
    }
  }
  const int64_t context_limit = limits.context_limit;
  if (context_limit > 0 && n >= context_limit) {
    return absl::InvalidArgumentError(PromptTooLongMessage(context_limit, n, "prompt"));
  }
  ValidatedGenerate out;
  out.context_limit = context_limit;
  absl::StatusOr<model::SamplingParams> sampling = proto::SamplingFromProto(request.sampling());
  if (!sampling.ok()) return sampling.status();
  out.sampling = *std::move(sampling);
  const v1::SamplingParams& sp = request.sampling();
  FLUXION_RETURN_IF_ERROR(proto::ValidatePromptLogprobs(sp, n));
  if (sp.has_max_tokens() && sp.max_tokens() == 0) {
    return absl::InvalidArgumentError("sampling.max_tokens must be >= 1 when set");
  }
  for (uint32_t stop : sp.stop_token_ids()) {
    if (stop >= static_cast<uint64_t>(limits.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.stop_token_ids holds ", stop, ", outside the vocabulary [0, ",
          limits.vocab_size, ")"));
    }
  }
  // A client may ask for at most what the context leaves after the prompt (-1 from protobufjs
  // arrives as 4294967295): a larger number would only hold the request until the context ends.
  if (sp.has_max_tokens() && context_limit > 0 &&
      static_cast<int64_t>(sp.max_tokens()) > context_limit - n) {
    return absl::InvalidArgumentError(absl::StrCat(
        RequestTooLongMessage(context_limit, n, sp.max_tokens(), "prompt"),
        " sampling.max_tokens may be at most ", context_limit - n, " (or unset)."));
  }
  out.max_tokens = sp.has_max_tokens()
                       ? static_cast<int64_t>(sp.max_tokens())
                       : (context_limit > 0 ? context_limit - n : int64_t{1} << 30);
  out.policy_name = limits.default_policy;
  double budget = limits.default_budget;
  if (request.has_sparse() && !request.sparse().policy().empty()) {
    out.policy_name = request.sparse().policy();
  }
  const std::string& policy_name = out.policy_name;
  absl::StatusOr<sparse::PolicyKind> kind = sparse::ParsePolicyKind(policy_name);
  if (!kind.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sparse: ", kind.status().message()));
  }
  if (request.has_sparse() && request.sparse().has_budget()) {
    if (sparse::TraitsOf(*kind).budget_from_name) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sparse.budget must be absent for policy '", policy_name, "', whose name fixes it"));
    }
    budget = request.sparse().budget();
  }
  if (*kind == sparse::PolicyKind::kFull) budget = 1.0;
  absl::StatusOr<sparse::PolicyConfig> policy = sparse::ParsePolicy(policy_name, budget);
  if (!policy.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sparse: ", policy.status().message()));
  }
  out.policy = *std::move(policy);
  return out;
}

}  // namespace fluxion::decode
