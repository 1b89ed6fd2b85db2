// From an OpenAI request to a fluxion.v1 GenerateRequest: the prompt rendered (chat template) and
// tokenized with the model's tokenizer, sampling fields mapped one to one (docs/PROTOCOL.md,
// "Mapping onto fluxion.v1").
//
// Thread-safe: pure functions (the tokenizer's const members are thread-safe).
#ifndef FLUXION_CLUSTER_OPENAI_GENERATE_H_
#define FLUXION_CLUSTER_OPENAI_GENERATE_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cluster/openai_request.h"
#include "fluxion/v1/decode.pb.h"
#include "model/tokenizer.h"

namespace fluxion::cluster::openai {

// The prompt text for a conversation, ending with the assistant turn's header. Empty function:
// the router has no chat template, and chat requests are refused.
using ChatRenderer = std::function<absl::StatusOr<std::string>(const std::vector<Message>&)>;

// InvalidArgument naming the field for a prompt that is empty after tokenization or holds ids
// outside the vocabulary, or a stop token id outside it; the renderer's error for chat; the
// tokenizer's (or `check`'s, which bounds the tokenization: model::EncodeCheck) naming the field.
absl::StatusOr<v1::GenerateRequest> PrepareGenerate(const Request& request,
                                                    const model::Tokenizer& tokenizer,
                                                    const ChatRenderer& chat,
                                                    const std::string& request_id,
                                                    const model::EncodeCheck& check = {});

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_GENERATE_H_
