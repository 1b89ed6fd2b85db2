// The words for a request longer than the model's context, as OpenAI writes them and clients match
// them ("This model's maximum context length is"): one source for the router's HTTP API
// (cluster/openai_generate.h) and the decode node's validation (decode/serving/
// generate_validation.h), so gRPC and HTTP clients read the same sentence.
#ifndef FLUXION_COMMON_CONTEXT_LENGTH_H_
#define FLUXION_COMMON_CONTEXT_LENGTH_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace fluxion {

// A prompt of `prompt` tokens that leaves no room in a `limit`-token context; `field` names it
// ("prompt", "messages").
inline std::string PromptTooLongMessage(int64_t limit, int64_t prompt, absl::string_view field) {
  return absl::StrCat("This model's maximum context length is ", limit,
                      " tokens. However, your ", field, " resulted in ", prompt,
                      " tokens. Please reduce the length of the ", field, ".");
}

// A prompt plus `completion` asked tokens beyond a `limit`-token context.
inline std::string RequestTooLongMessage(int64_t limit, int64_t prompt, int64_t completion,
                                         absl::string_view field) {
  return absl::StrCat("This model's maximum context length is ", limit,
                      " tokens. However, you requested ", prompt + completion, " tokens (", prompt,
                      " in the ", field, ", ", completion,
                      " in the completion). Please reduce the length of the ", field,
                      " or completion.");
}

}  // namespace fluxion

#endif  // FLUXION_COMMON_CONTEXT_LENGTH_H_
