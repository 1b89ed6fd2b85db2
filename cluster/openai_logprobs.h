// The answer's log-probability entries (openai_response.h LogprobEntry) made from what the engine
// streams (fluxion.v1 TokenLogprobs: ids and numbers) and the model's tokenizer: each token's
// text, its raw bytes, and, for completions, where its text starts in the choice's text.
//
// A token's text is its bytes made valid UTF-8 on their own (a byte-level token holding part of a
// character shows U+FFFD there, as vLLM shows it); `bytes` keeps the exact bytes, which chat's
// answer lists for clients that join partial characters.
//
// Thread-compatible: one per choice.
#ifndef FLUXION_CLUSTER_OPENAI_LOGPROBS_H_
#define FLUXION_CLUSTER_OPENAI_LOGPROBS_H_

#include <cstdint>

#include "cluster/openai_response.h"
#include "fluxion/v1/common.pb.h"
#include "model/tokenizer.h"

namespace fluxion::cluster::openai {

class LogprobTrack {
 public:
  // `tokenizer` must outlive the track.
  explicit LogprobTrack(const model::Tokenizer* tokenizer) : tokenizer_(tokenizer) {}

  // The entry of token `id` with the engine's numbers `l` (null: none, an echoed prompt's first
  // token), at the running text offset, which then moves past the token's text.
  LogprobEntry Add(uint32_t id, const v1::TokenLogprobs* l);

 private:
  std::string Text(uint32_t id, std::string* bytes) const;

  const model::Tokenizer* tokenizer_;
  int64_t text_offset_ = 0;  // code points so far
};

// Code points in valid UTF-8 `text` (Python's len(), which vLLM's text_offset counts).
int64_t CodePoints(absl::string_view text);

}  // namespace fluxion::cluster::openai

#endif  // FLUXION_CLUSTER_OPENAI_LOGPROBS_H_
