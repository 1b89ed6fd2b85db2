// The byte-level tokenizer of Fluxion's own models (docs/TASKS.md, "Vocabulary"): token id = byte
// value for 0-255, plus three specials. There is nothing to learn or load, so every member is
// static; the class only groups the ids with the two functions that use them.
//
// Thread-safe: pure functions.
#ifndef FLUXION_MODEL_BYTE_TOKENIZER_H_
#define FLUXION_MODEL_BYTE_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace fluxion::model {

class ByteTokenizer {
 public:
  static constexpr int32_t kBos = 256;
  static constexpr int32_t kEos = 257;
  static constexpr int32_t kPad = 258;
  // Ids 259-263 are unused; models pad their vocabulary to this size.
  static constexpr int32_t kVocabSize = 264;

  // One id per byte of `text` (bytes >= 0x80 map to 128-255, never to negative ids), preceded by
  // kBos when `add_bos`.
  static std::vector<int32_t> Encode(absl::string_view text, bool add_bos);

  // The inverse of Encode for ids 0-255. Specials are written as `<bos>`, `<eos>`, `<pad>` and any
  // other id as `<unk:N>`, so a decoded model output shows exactly what was generated; this also
  // means Decode is not injective (the text "<eos>" and id 257 decode alike).
  static std::string Decode(absl::Span<const int32_t> ids);

  ByteTokenizer() = delete;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_BYTE_TOKENIZER_H_
