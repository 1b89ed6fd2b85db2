// libFuzzer target: tokenizer.json text -> HfTokenizer::FromJson. Any input must give a tokenizer
// or an error status: no crash, no sanitizer report, no unbounded allocation. An accepted
// tokenizer must encode a varied text without crashing (an error is allowed: a hostile pattern may
// hit the match limit), decode it, and stream-detokenize it to the same text (but for the leading
// space a SentencePiece-style decode strips). docs/FUZZING.md.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "model/hf_tokenizer.h"
#include "model/stream_detokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using fluxion::model::HfTokenizer;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tokenizer = HfTokenizer::FromJson(text);
  if (!tokenizer.ok()) return 0;
  const std::string sample =
      "Hello, world! <|im_start|>user\n  it's 12345 caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC "
      "\xF0\x9F\x99\x82\t\r\n<|endoftext|>";
  absl::StatusOr<std::vector<int32_t>> ids = (*tokenizer)->Encode(sample);
  if (!ids.ok()) return 0;
  for (int32_t id : *ids) {
    if (id < 0 || id >= (*tokenizer)->vocab_size()) __builtin_trap();
  }
  const std::string decoded = (*tokenizer)->Decode(*ids, /*skip_special=*/false);
  auto stream = fluxion::model::StreamDetokenizer::Create(tokenizer->get(),
                                                          {/*skip_special=*/false, /*stop=*/{}});
  if (!stream.ok()) __builtin_trap();
  std::string streamed;
  for (int32_t id : *ids) streamed += stream->Add(id);
  streamed += stream->Finish();
  // The stream keeps the leading space a SentencePiece-style Decode strips.
  if ((*tokenizer)->StripDecodedStart(streamed) != decoded) __builtin_trap();
  return 0;
}
