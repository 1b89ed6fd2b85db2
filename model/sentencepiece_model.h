// A SentencePiece `tokenizer.model` (the checkpoint ships no tokenizer.json) as the tokenizer.json
// Hugging Face's converter writes for it (transformers' LlamaConverter: SentencePiece BPE with
// byte fallback), so HfTokenizer serves both the same way: every piece in the vocabulary at its
// index; control, unknown and user-defined pieces as added tokens (not normalized; the first two
// special); the merges of every piece that splits into two pieces, ranked by the merged piece's
// score (SentencePiece's BPE merges the best-scoring adjacent pair first); a "▁" prepended when
// add_dummy_prefix and spaces replaced by "▁"; the decoder undoing both.
//
// Thread-safe: a pure function.
#ifndef FLUXION_MODEL_SENTENCEPIECE_MODEL_H_
#define FLUXION_MODEL_SENTENCEPIECE_MODEL_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {

inline constexpr size_t kMaxSentencePieceModelBytes = size_t{64} << 20;

// InvalidArgument, naming what, for a file that is not a ModelProto or that this reader does not
// serve: a unigram / word / char model, a normalization rule other than identity (a precompiled
// character map: NFKC), remove_extra_whitespaces (SentencePiece collapses runs of spaces, which
// no tokenizer.json normalizer here does), escape_whitespaces off, more pieces than a
// tokenizer.json may hold, an empty, repeated, over-long (kMaxTokenBytes) or non-UTF-8 piece.
absl::StatusOr<nlohmann::json> SentencePieceToTokenizerJson(absl::string_view model_bytes);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_SENTENCEPIECE_MODEL_H_
