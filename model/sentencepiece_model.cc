#include "model/sentencepiece_model.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/hf_tokenizer.h"
#include "model/tokenizer.h"
#include "sentencepiece/model.pb.h"

namespace fluxion::model {
namespace {

using Json = nlohmann::json;
using Piece = sentencepiece::ModelProto::SentencePiece;

constexpr const char* kMark = "\xE2\x96\x81";  // U+2581, what spaces become

absl::Status Unsupported(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.model: ", what));
}

// Byte offsets of the characters of valid-or-not UTF-8 `text` after the first (the split points
// of a piece into two non-empty parts).
std::vector<size_t> CharacterBoundaries(const std::string& text) {
  std::vector<size_t> out;
  for (size_t i = 1; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) out.push_back(i);
  }
  return out;
}

// The merges HF's SentencePieceExtractor derives: for every piece, each split into two pieces
// (ordered by the parts' ids), all ranked by the merged piece's score, highest first (stable).
Json Merges(const sentencepiece::ModelProto& m,
            const absl::flat_hash_map<std::string, int32_t>& ids) {
  struct Merge {
    float score;
    int32_t left, right;
  };
  std::vector<Merge> merges;
  for (const Piece& p : m.pieces()) {
    std::vector<Merge> local;
    for (size_t at : CharacterBoundaries(p.piece())) {
      auto l = ids.find(p.piece().substr(0, at));
      auto r = ids.find(p.piece().substr(at));
      if (l != ids.end() && r != ids.end()) local.push_back({p.score(), l->second, r->second});
    }
    std::sort(local.begin(), local.end(), [](const Merge& a, const Merge& b) {
      return std::tie(a.left, a.right) < std::tie(b.left, b.right);
    });
    merges.insert(merges.end(), local.begin(), local.end());
  }
  std::stable_sort(merges.begin(), merges.end(),
                   [](const Merge& a, const Merge& b) { return a.score > b.score; });
  Json out = Json::array();
  for (const Merge& x : merges) {
    out.push_back(Json::array({m.pieces(x.left).piece(), m.pieces(x.right).piece()}));
  }
  return out;
}

absl::Status CheckServed(const sentencepiece::ModelProto& m) {
  if (m.trainer_spec().model_type() != sentencepiece::TrainerSpec::BPE) {
    return Unsupported(absl::StrCat(
        "model type ", sentencepiece::TrainerSpec::ModelType_Name(m.trainer_spec().model_type()),
        " is not supported (only BPE); use the checkpoint's tokenizer.json if it has one"));
  }
  const sentencepiece::NormalizerSpec& n = m.normalizer_spec();
  if (!n.precompiled_charsmap().empty() && n.name() != "identity") {
    return Unsupported(absl::StrCat("normalization rule '", n.name(),
                                    "' is not supported (only identity)"));
  }
  if (n.remove_extra_whitespaces()) {
    return Unsupported("remove_extra_whitespaces is not supported (runs of spaces would be kept)");
  }
  if (!n.escape_whitespaces()) return Unsupported("escape_whitespaces off is not supported");
  if (m.pieces_size() == 0 || m.pieces_size() > kMaxTokenizerVocab) {
    return Unsupported(absl::StrCat("has ", m.pieces_size(), " pieces, outside [1, ",
                                    kMaxTokenizerVocab, "]"));
  }
  const int32_t unk = m.trainer_spec().unk_id();
  if (unk < 0 || unk >= m.pieces_size()) {
    return Unsupported(absl::StrCat("unk_id ", unk, " is not a piece"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Json> SentencePieceToTokenizerJson(absl::string_view model_bytes) {
  if (model_bytes.size() > kMaxSentencePieceModelBytes) {
    return Unsupported(absl::StrCat("of ", model_bytes.size(), " bytes is above the limit of ",
                                    kMaxSentencePieceModelBytes));
  }
  sentencepiece::ModelProto m;
  if (!m.ParseFromArray(model_bytes.data(), static_cast<int>(model_bytes.size()))) {
    return Unsupported("is not a SentencePiece ModelProto");
  }
  FLUXION_RETURN_IF_ERROR(CheckServed(m));
  Json vocab = Json::object();
  Json added = Json::array();
  absl::flat_hash_map<std::string, int32_t> ids;
  for (int32_t id = 0; id < m.pieces_size(); ++id) {
    const Piece& p = m.pieces(id);
    // Bounded before the merges are derived: each piece is split at every character.
    if (p.piece().empty() || p.piece().size() > kMaxTokenBytes) {
      return Unsupported(absl::StrCat("piece ", id, " is empty or longer than ", kMaxTokenBytes,
                                      " bytes"));
    }
    // proto2 strings are bytes: one that is not UTF-8 would not survive the JSON hand-over.
    if (!IsValidUtf8(p.piece())) {
      return Unsupported(absl::StrCat("piece ", id, " is not valid UTF-8"));
    }
    if (!ids.emplace(p.piece(), id).second) {
      return Unsupported(absl::StrCat("piece ", id, " repeats an earlier one"));
    }
    vocab[p.piece()] = id;
    if (p.type() == Piece::CONTROL || p.type() == Piece::UNKNOWN ||
        p.type() == Piece::USER_DEFINED) {
      added.push_back({{"id", id},
                       {"content", p.piece()},
                       {"special", p.type() != Piece::USER_DEFINED},
                       {"normalized", false}});
    }
  }
  const bool dummy_prefix = m.normalizer_spec().add_dummy_prefix();
  Json normalizers = Json::array();
  if (dummy_prefix) normalizers.push_back({{"type", "Prepend"}, {"prepend", kMark}});
  normalizers.push_back({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMark}});
  Json j;
  j["model"] = {{"type", "BPE"},
                {"vocab", std::move(vocab)},
                {"merges", Merges(m, ids)},
                {"unk_token", m.pieces(m.trainer_spec().unk_id()).piece()},
                {"byte_fallback", m.trainer_spec().byte_fallback()},
                {"fuse_unk", true}};
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", std::move(normalizers)}};
  j["pre_tokenizer"] = nullptr;
  j["added_tokens"] = std::move(added);
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders", Json::array({{{"type", "Replace"},
                                             {"pattern", {{"String", kMark}}},
                                             {"content", " "}},
                                            {{"type", "ByteFallback"}},
                                            {{"type", "Fuse"}},
                                            {{"type", "Strip"},
                                             {"content", " "},
                                             {"start", dummy_prefix ? 1 : 0},
                                             {"stop", 0}}})}};
  return j;
}

}  // namespace fluxion::model
