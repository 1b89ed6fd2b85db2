#include "model/byte_tokenizer.h"

#include "absl/strings/str_cat.h"

namespace fluxion::model {

std::vector<int32_t> ByteTokenizer::Encode(absl::string_view text, bool add_bos) {
  std::vector<int32_t> ids;
  ids.reserve(text.size() + (add_bos ? 1 : 0));
  if (add_bos) ids.push_back(kBos);
  for (char c : text) ids.push_back(static_cast<int32_t>(static_cast<unsigned char>(c)));
  return ids;
}

std::string ByteTokenizer::Decode(absl::Span<const int32_t> ids) {
  std::string text;
  text.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && id < 256) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else if (id == kBos) {
      text += "<bos>";
    } else if (id == kEos) {
      text += "<eos>";
    } else if (id == kPad) {
      text += "<pad>";
    } else {
      absl::StrAppend(&text, "<unk:", id, ">");
    }
  }
  return text;
}

}  // namespace fluxion::model
