// libFuzzer target: tokenizer.model bytes -> SentencePieceToTokenizerJson -> HfTokenizer. Any
// input must give a tokenizer or an error status: no crash, no sanitizer report, no unbounded
// work (pieces are bounded before the merges are derived). An accepted one must encode a varied
// text to ids inside its vocabulary. docs/FUZZING.md.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "model/hf_tokenizer.h"
#include "model/sentencepiece_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using fluxion::model::HfTokenizer;
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<nlohmann::json> converted = fluxion::model::SentencePieceToTokenizerJson(bytes);
  if (!converted.ok()) return 0;
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tokenizer = HfTokenizer::FromJson(converted->dump());
  if (!tokenizer.ok()) return 0;
  absl::StatusOr<std::vector<int32_t>> ids =
      (*tokenizer)->Encode("Hello, world!  caf\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x99\x82\t\n<s>x");
  if (!ids.ok()) return 0;
  for (int32_t id : *ids) {
    if (id < 0 || id >= (*tokenizer)->vocab_size()) __builtin_trap();
  }
  return 0;
}
