#include "cluster/router_validation.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace fluxion::cluster {

namespace v1 = ::fluxion::v1;

absl::Status ValidateRouterRequest(const v1::GenerateRequest& request) {
  const std::string& id = request.request_id();
  if (id.empty() || id.size() > 128) {
    return absl::InvalidArgumentError("request_id must be 1 to 128 bytes");
  }
  if (request.protocol_version() > v1::PROTOCOL_VERSION_1) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", id, ": protocol_version ", request.protocol_version(),
                     " is above the router's (1); stamp the lower of yours and GetLoad's "
                     "server.protocol_version"));
  }
  if (request.prompt_token_ids_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("request ", id, ": empty prompt"));
  }
  return absl::OkStatus();
}

}  // namespace fluxion::cluster
