// No Abseil header may be included here (sentencepiece_shim.h says why).
#include "model/sentencepiece_shim.h"

#include <sentencepiece_processor.h>


namespace fluxion::model {

struct SentencePieceShim::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

SentencePieceShim::SentencePieceShim() : impl_(std::make_unique<Impl>()) {}
SentencePieceShim::~SentencePieceShim() = default;

bool SentencePieceShim::Load(std::string_view serialized, std::string* error) {
  const sentencepiece::util::Status s = impl_->processor.LoadFromSerializedProto(serialized);
  if (!s.ok()) *error = s.ToString();
  return s.ok();
}

bool SentencePieceShim::Encode(std::string_view text, std::vector<int>* ids,
                               std::string* error) const {
  const sentencepiece::util::Status s = impl_->processor.Encode(text, ids);
  if (!s.ok()) *error = s.ToString();
  return s.ok();
}

int SentencePieceShim::PieceCount() const { return impl_->processor.GetPieceSize(); }
const std::string& SentencePieceShim::Piece(int id) const {
  return impl_->processor.IdToPiece(id);
}
int SentencePieceShim::PieceToId(std::string_view piece) const {
  return impl_->processor.PieceToId(piece);
}
bool SentencePieceShim::IsControl(int id) const { return impl_->processor.IsControl(id); }
bool SentencePieceShim::IsUnknown(int id) const { return impl_->processor.IsUnknown(id); }
bool SentencePieceShim::IsByte(int id) const { return impl_->processor.IsByte(id); }

}  // namespace fluxion::model
