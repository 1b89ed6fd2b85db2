// Text <-> token ids for a model (docs/TOKENIZER.md). Two implementations: the byte tokenizer of
// Fluxion's own models (byte_tokenizer.h) and Hugging Face tokenizer.json byte-level BPE
// (hf_tokenizer.h). LoadTokenizer picks the one a model directory holds. The servers still speak
// token ids; this is the seam the text endpoints will use.
//
// Thread-safe: every implementation's const members may be called concurrently.
#ifndef FLUXION_MODEL_TOKENIZER_H_
#define FLUXION_MODEL_TOKENIZER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace fluxion::model {

// A caller's bound on one Encode: called before the work starts and then after every bounded
// amount of it; the first non-OK status it returns ends the encoding with that status. A server
// uses it to give up on a text too expensive for its tokenizer (a deadline) or whose client went
// away. Called on the encoding thread; must be cheap.
using EncodeCheck = std::function<absl::Status()>;

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // The ids of `text`, with no BOS or other template tokens added (HF's
  // `encode(text, add_special_tokens=False)`); special tokens written in the text are matched.
  // InvalidArgument when `text` is not valid UTF-8, or when the text cannot be split (a
  // pre-tokenizer regex that gives up on it).
  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const {
    return EncodeChecked(text, EncodeCheck());
  }
  // Encode, bounded by `check` (when set).
  virtual absl::StatusOr<std::vector<int32_t>> EncodeChecked(absl::string_view text,
                                                             const EncodeCheck& check) const = 0;

  // Appends the bytes id `id` stands for to `out`; they need not be valid UTF-8 on their own (a
  // byte-level token can hold half a character). Ids outside the vocabulary append nothing, as
  // HF's decode skips them; so do special ids when `skip_special`.
  virtual void AppendTokenBytes(int32_t id, bool skip_special, std::string* out) const = 0;

  // The text of `ids`: their bytes concatenated, with each invalid UTF-8 sequence replaced by
  // U+FFFD as HF (Rust's String::from_utf8_lossy) does. Always valid UTF-8.
  std::string Decode(absl::Span<const int32_t> ids, bool skip_special) const;

  // Lookups. `token` is the vocabulary's spelling (for byte-level BPE, "Ġthe" for " the").
  virtual std::optional<int32_t> TokenToId(absl::string_view token) const = 0;
  virtual std::optional<std::string> IdToToken(int32_t id) const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;
  // One more than the largest id (ids below it may still be unused).
  virtual int32_t vocab_size() const = 0;
  // Spaces the tokenizer's decoder strips from the start of a decoded text (a SentencePiece-style
  // tokenizer strips the one its normalizer prepends). Decode strips them; a streamed
  // continuation (stream_detokenizer.h) keeps them, since its text continues the prompt's.
  virtual int leading_spaces_stripped() const { return 0; }
  // `text` without the leading spaces Decode strips: a streamed text as Decode gives it.
  absl::string_view StripDecodedStart(absl::string_view text) const;
};

// The byte tokenizer (byte_tokenizer.h) behind the interface. Encode adds no BOS; Decode writes
// specials as ByteTokenizer::Decode does (`<eos>`) unless skipped, and bytes that are not UTF-8 as
// U+FFFD.
std::unique_ptr<Tokenizer> NewByteTokenizer();

// The tokenizer of the model in `model_dir`: its tokenizer.json when present (HfTokenizer), else
// its SentencePiece tokenizer.model converted as HF does (sentencepiece_model.h), else the byte
// tokenizer when config.json describes one of our own byte-level models (vocab_size 264,
// bos/eos/pad 256/257/258), else FailedPrecondition saying what is missing. Errors of a present
// but bad tokenizer.json are InvalidArgument naming the field.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir);

// UTF-8 helpers shared by Decode and the stream detokenizer.
//
// Converts `bytes` to valid UTF-8 appended to `out`, each maximal invalid subpart becoming U+FFFD
// (Unicode 3.9 "substitution of maximal subparts", which Rust's from_utf8_lossy follows). When not
// `final`, an incomplete sequence at the end that more bytes could still complete is left
// unconverted. Returns the number of bytes consumed (== bytes.size() when `final`).
size_t AppendUtf8Lossy(absl::string_view bytes, bool final, std::string* out);

// Whether `text` is valid UTF-8 (no surrogates, no overlong forms, at most U+10FFFF).
bool IsValidUtf8(absl::string_view text);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_TOKENIZER_H_
