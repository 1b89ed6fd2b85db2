#include "model/sentencepiece_tokenizer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/json_text.h"

namespace fluxion::model {
namespace {

constexpr size_t kMaxModelBytes = size_t{64} << 20;
constexpr char kSpaceMark[] = "\xe2\x96\x81";  // U+2581, SentencePiece's space

// "<0x0A>" -> 0x0A; nullopt for anything else.
std::optional<char> BytePiece(const std::string& piece) {
  if (piece.size() != 6 || piece.compare(0, 3, "<0x") != 0 || piece[5] != '>') return std::nullopt;
  int value = 0;
  for (char c : piece.substr(3, 2)) {
    value *= 16;
    if (c >= '0' && c <= '9') value += c - '0';
    else if (c >= 'A' && c <= 'F') value += c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') value += c - 'a' + 10;
    else return std::nullopt;
  }
  return static_cast<char>(value);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::FromFile(
    const std::string& path) {
  FLUXION_ASSIGN_OR_RETURN(std::string bytes, ReadFileBounded(path, kMaxModelBytes));
  return FromBytes(bytes, path);
}

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::FromBytes(
    absl::string_view bytes, absl::string_view what) {
  std::unique_ptr<SentencePieceTokenizer> t(new SentencePieceTokenizer());
  std::string error;
  if (!t->shim_.Load(std::string_view(bytes.data(), bytes.size()), &error)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not a SentencePiece model: ", error));
  }
  for (int id = 0; id < t->shim_.PieceCount(); ++id) {
    if (t->shim_.IsControl(id) && !t->shim_.Piece(id).empty()) {
      t->controls_.emplace_back(t->shim_.Piece(id), id);
    }
  }
  std::sort(t->controls_.begin(), t->controls_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  return t;
}

absl::Status SentencePieceTokenizer::EncodePlain(absl::string_view text,
                                                 std::vector<int32_t>* ids) const {
  if (text.empty()) return absl::OkStatus();
  std::vector<int> out;
  std::string error;
  if (!shim_.Encode(std::string_view(text.data(), text.size()), &out, &error)) {
    return absl::InvalidArgumentError(absl::StrCat("SentencePiece could not encode: ", error));
  }
  ids->insert(ids->end(), out.begin(), out.end());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> SentencePieceTokenizer::EncodeChecked(
    absl::string_view text, const EncodeCheck& check) const {
  if (!IsValidUtf8(text)) return absl::InvalidArgumentError("the text is not valid UTF-8");
  std::vector<int32_t> ids;
  while (!text.empty()) {
    if (check) FLUXION_RETURN_IF_ERROR(check());
    // The leftmost control piece written in the text, the longest at that place.
    size_t at = absl::string_view::npos;
    const std::pair<std::string, int32_t>* found = nullptr;
    for (const auto& control : controls_) {
      const size_t pos = text.find(control.first);
      if (pos < at) {
        at = pos;
        found = &control;
      }
    }
    FLUXION_RETURN_IF_ERROR(EncodePlain(text.substr(0, at), &ids));
    if (found == nullptr) break;
    ids.push_back(found->second);
    text.remove_prefix(at + found->first.size());
  }
  if (check) FLUXION_RETURN_IF_ERROR(check());
  return ids;
}

void SentencePieceTokenizer::AppendTokenBytes(int32_t id, bool skip_special,
                                              std::string* out) const {
  if (id < 0 || id >= shim_.PieceCount()) return;
  const std::string& piece = shim_.Piece(id);
  if (IsSpecial(id)) {
    if (!skip_special) out->append(piece);
    return;
  }
  if (shim_.IsByte(id)) {
    if (std::optional<char> byte = BytePiece(piece)) out->push_back(*byte);
    return;
  }
  for (size_t i = 0; i < piece.size();) {
    if (piece.compare(i, 3, kSpaceMark) == 0) {
      out->push_back(' ');
      i += 3;
    } else {
      out->push_back(piece[i++]);
    }
  }
}

std::optional<int32_t> SentencePieceTokenizer::TokenToId(absl::string_view token) const {
  const int id = shim_.PieceToId(std::string_view(token.data(), token.size()));
  if (id < 0 || id >= shim_.PieceCount() || shim_.Piece(id) != token) return std::nullopt;
  return id;
}

std::optional<std::string> SentencePieceTokenizer::IdToToken(int32_t id) const {
  if (id < 0 || id >= shim_.PieceCount()) return std::nullopt;
  return shim_.Piece(id);
}

bool SentencePieceTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < shim_.PieceCount() && (shim_.IsControl(id) || shim_.IsUnknown(id));
}

}  // namespace fluxion::model
