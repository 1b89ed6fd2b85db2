// SentencePiece tokenizer.model (Llama 2, Mistral, Gemma style) behind model::Tokenizer, through
// Debian's libsentencepiece (model/sentencepiece_shim.h says why through a shim).
//
// Encode: the model's control pieces written in the text (`<s>`, `</s>`) are cut out first,
// leftmost, longest first, as Hugging Face's slow LlamaTokenizer splits on its special tokens;
// each stretch between them is segmented by SentencePiece itself (its normalizer, the dummy
// prefix, byte fallback). Nothing is added (no BOS), as Tokenizer::Encode promises.
// Token bytes: "▁" (U+2581) is a space, `<0xNN>` pieces are that byte, control and unknown
// pieces are special. One difference from HF's `decode` of a whole sequence: the space of a
// leading "▁" is kept (HF strips it), which is what a generated continuation needs.
//
// Thread-safe after FromFile.
#ifndef FLUXION_MODEL_SENTENCEPIECE_TOKENIZER_H_
#define FLUXION_MODEL_SENTENCEPIECE_TOKENIZER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/sentencepiece_shim.h"
#include "model/tokenizer.h"

namespace fluxion::model {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // The model at `path`, at most 64 MiB. InvalidArgument naming the path when it does not parse.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> FromFile(const std::string& path);
  // From a serialized ModelProto (tests).
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> FromBytes(absl::string_view bytes,
                                                                           absl::string_view what);

  absl::StatusOr<std::vector<int32_t>> EncodeChecked(absl::string_view text,
                                                     const EncodeCheck& check) const override;
  void AppendTokenBytes(int32_t id, bool skip_special, std::string* out) const override;
  std::optional<int32_t> TokenToId(absl::string_view token) const override;
  std::optional<std::string> IdToToken(int32_t id) const override;
  bool IsSpecial(int32_t id) const override;
  int32_t vocab_size() const override { return shim_.PieceCount(); }

 private:
  SentencePieceTokenizer() = default;
  // Appends the ids of a stretch without control pieces.
  absl::Status EncodePlain(absl::string_view text, std::vector<int32_t>* ids) const;

  SentencePieceShim shim_;
  // The control pieces as text, longest first, with their ids (the specials matched in text).
  std::vector<std::pair<std::string, int32_t>> controls_;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_SENTENCEPIECE_TOKENIZER_H_
