#include "cluster/openai_logprobs.h"

namespace fluxion::cluster::openai {

int64_t CodePoints(absl::string_view text) {
  int64_t n = 0;
  for (unsigned char c : text) n += (c & 0xC0) != 0x80;  // every byte but continuation bytes
  return n;
}

std::string LogprobTrack::Text(uint32_t id, std::string* bytes) const {
  bytes->clear();
  tokenizer_->AppendTokenBytes(static_cast<int32_t>(id), /*skip_special=*/false, bytes);
  std::string text;
  model::AppendUtf8Lossy(*bytes, /*final=*/true, &text);
  return text;
}

LogprobEntry LogprobTrack::Add(uint32_t id, const v1::TokenLogprobs* l) {
  LogprobEntry e;
  e.token = Text(id, &e.bytes);
  e.text_offset = text_offset_;
  text_offset_ += CodePoints(e.token);
  if (l == nullptr) return e;
  e.logprob = l->logprob();
  const int alternatives = std::min(l->top_token_ids_size(), l->top_logprobs_size());
  e.top.reserve(alternatives);
  for (int i = 0; i < alternatives; ++i) {
    LogprobAlternative a;
    a.token = Text(l->top_token_ids(i), &a.bytes);
    a.logprob = l->top_logprobs(i);
    e.top.push_back(std::move(a));
  }
  return e;
}

}  // namespace fluxion::cluster::openai
