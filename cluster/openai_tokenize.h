// vLLM's POST /tokenize and POST /detokenize on the router's HTTP API (docs/PROTOCOL.md,
// "Tokenize and detokenize"): the same tokenizer and chat template as the completions endpoints,
// so a client counts tokens exactly as a completion will. Answered by the router alone (no node
// is called), on a worker like every body (openai_call.h).
//
// Thread-safe: pure functions.
#ifndef FLUXION_CLUSTER_OPENAI_TOKENIZE_H_
#define FLUXION_CLUSTER_OPENAI_TOKENIZE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cluster/openai_call.h"
#include "model/tokenizer.h"

namespace fluxion::cluster::openai {

// {"prompt": TEXT} or {"messages": [...]} (and optionally "model", which must be the served
// one) -> {"count", "max_model_len", "tokens", "token_strs": null}. 400 naming the field for
// what vLLM takes and this server does not (add_special_tokens true: prompts are tokenized as
// the completions endpoint does, with nothing added); 404 for another model; `cancelled` bounds
// the tokenization as in Prepare.
absl::StatusOr<std::string> TokenizeAnswer(const Preparer& preparer, absl::string_view body,
                                           const model::EncodeCheck& cancelled);

// {"tokens": [ids]} (and optionally "model") -> {"prompt": TEXT}, special tokens included as
// Hugging Face's decode writes them by default. 400 for ids outside the vocabulary.
absl::StatusOr<std::string> DetokenizeAnswer(const Preparer& preparer, absl::string_view body);

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_TOKENIZE_H_
