// A std-only face on Debian's libsentencepiece (0.1.97). Its header declares
// `namespace absl { using std::string_view; }`, which clashes with Abseil's own string_view, so
// only sentencepiece_shim.cc includes it, and no Abseil header is included there. Everything
// above (SentencePieceTokenizer, model/sentencepiece_tokenizer.h) goes through this class.
//
// Thread-safe after Load: the processor's const methods are.
#ifndef FLUXION_MODEL_SENTENCEPIECE_SHIM_H_
#define FLUXION_MODEL_SENTENCEPIECE_SHIM_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fluxion::model {

class SentencePieceShim {
 public:
  SentencePieceShim();
  ~SentencePieceShim();
  SentencePieceShim(const SentencePieceShim&) = delete;
  SentencePieceShim& operator=(const SentencePieceShim&) = delete;

  // Loads a serialized ModelProto (a tokenizer.model file's bytes). False with *error set when it
  // does not parse.
  bool Load(std::string_view serialized, std::string* error);
  // The ids of `text` as the model segments it (its normalizer, dummy prefix, byte fallback).
  bool Encode(std::string_view text, std::vector<int>* ids, std::string* error) const;

  int PieceCount() const;
  // Valid for 0 <= id < PieceCount().
  const std::string& Piece(int id) const;
  int PieceToId(std::string_view piece) const;  // the unknown id for a piece not in the vocabulary
  bool IsControl(int id) const;
  bool IsUnknown(int id) const;
  bool IsByte(int id) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_SENTENCEPIECE_SHIM_H_
