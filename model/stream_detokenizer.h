// Streaming detokenization (docs/TOKENIZER.md): ids go in one at a time, text that is final comes
// out. Final means it will not change whatever ids follow:
//  - an incomplete UTF-8 sequence at the end is held back until its bytes arrive (a byte-level
//    token may carry half an emoji); bytes that can no longer become valid are U+FFFD at once, and
//    an incomplete tail at Finish() is one U+FFFD, exactly as the whole decode (Tokenizer::Decode)
//    would write them, so the concatenated output always equals Decode(all ids);
//  - with stop strings, text from the start of the first stop string to complete on is never
//    emitted, and text that could still be the start of one is held back until decided.
//
// Not thread-safe: one per request.
#ifndef FLUXION_MODEL_STREAM_DETOKENIZER_H_
#define FLUXION_MODEL_STREAM_DETOKENIZER_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/tokenizer.h"

namespace fluxion::model {

inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopStringBytes = 1024;

struct StreamDetokenizerOptions {
  bool skip_special = true;
  // Non-empty, valid UTF-8, at most kMaxStopStrings of at most kMaxStopStringBytes each.
  std::vector<std::string> stop;
};

class StreamDetokenizer {
 public:
  // `tokenizer` must outlive the detokenizer. InvalidArgument for bad stop strings.
  static absl::StatusOr<StreamDetokenizer> Create(const Tokenizer* tokenizer,
                                                  StreamDetokenizerOptions options);

  // Feeds one id; returns the text that became final (often empty). After a stop string was
  // seen, returns nothing more.
  std::string Add(int32_t id);

  // No more ids: returns the rest (an incomplete UTF-8 tail as U+FFFD, held-back text that turned
  // out not to be a stop string).
  std::string Finish();

  // Whether a stop string was matched, and which: the one that ends first in the text, the
  // longest of those ending there (so the answer does not depend on how tokens split the text).
  bool stopped() const { return matched_stop_.has_value(); }
  const std::optional<std::string>& matched_stop() const { return matched_stop_; }

 private:
  StreamDetokenizer(const Tokenizer* tokenizer, StreamDetokenizerOptions options)
      : tokenizer_(tokenizer), options_(std::move(options)) {}

  // Moves the decided part of pending_ to the returned text; `final`: nothing more will come.
  std::string Release(bool final);

  const Tokenizer* tokenizer_;
  StreamDetokenizerOptions options_;
  std::string bytes_;    // undecoded bytes: an incomplete UTF-8 sequence
  std::string pending_;  // decoded text held back because a stop string may start in it
  std::optional<std::string> matched_stop_;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_STREAM_DETOKENIZER_H_
