#include "model/tokenizer.h"

#include <sys/stat.h>

#include <cerrno>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/byte_tokenizer.h"
#include "model/config.h"
#include "model/hf_tokenizer.h"
#include "model/json_text.h"
#include "model/sentencepiece_model.h"

namespace fluxion::model {
namespace {

constexpr absl::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// The length of the UTF-8 sequence led by `lead` and the valid range of its second byte
// (Unicode 3.9 table 3-7); 0 for a byte that cannot lead one.
struct LeadInfo {
  int length;
  unsigned char second_lo;
  unsigned char second_hi;
};

LeadInfo Lead(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};  // no surrogates
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};  // at most U+10FFFF
  return {0, 0, 0};
}

// How many bytes from `pos` form a valid prefix of the sequence led by bytes[pos] (stopping at the
// first byte out of range or at the end), given `info` for its lead.
int ValidPrefix(absl::string_view bytes, size_t pos, const LeadInfo& info) {
  int n = 1;
  while (n < info.length && pos + n < bytes.size()) {
    const auto b = static_cast<unsigned char>(bytes[pos + n]);
    const unsigned char lo = n == 1 ? info.second_lo : 0x80;
    const unsigned char hi = n == 1 ? info.second_hi : 0xBF;
    if (b < lo || b > hi) break;
    ++n;
  }
  return n;
}

// Our own models' tokenizer (byte_tokenizer.h) behind the interface.
class ByteTokenizerAdapter final : public Tokenizer {
 public:
  // Linear in the text (one id per byte): one check is enough.
  absl::StatusOr<std::vector<int32_t>> EncodeChecked(absl::string_view text,
                                                     const EncodeCheck& check) const override {
    if (check) {
      if (absl::Status s = check(); !s.ok()) return s;
    }
    if (!IsValidUtf8(text)) return absl::InvalidArgumentError("text is not valid UTF-8");
    return ByteTokenizer::Encode(text, /*add_bos=*/false);
  }
  void AppendTokenBytes(int32_t id, bool skip_special, std::string* out) const override {
    if (id < 0 || id >= ByteTokenizer::kVocabSize) return;
    if (id >= 256 && skip_special) return;
    const int32_t one[] = {id};
    out->append(ByteTokenizer::Decode(one));
  }
  std::optional<int32_t> TokenToId(absl::string_view token) const override {
    for (int32_t id = 256; id < ByteTokenizer::kVocabSize; ++id) {
      if (*IdToToken(id) == token) return id;
    }
    if (token.size() == 1) return static_cast<int32_t>(static_cast<unsigned char>(token[0]));
    return std::nullopt;
  }
  std::optional<std::string> IdToToken(int32_t id) const override {
    if (id < 0 || id >= ByteTokenizer::kVocabSize) return std::nullopt;
    const int32_t one[] = {id};
    return ByteTokenizer::Decode(one);
  }
  bool IsSpecial(int32_t id) const override { return id >= 256 && id < ByteTokenizer::kVocabSize; }
  int32_t vocab_size() const override { return ByteTokenizer::kVocabSize; }
};

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

}  // namespace

size_t AppendUtf8Lossy(absl::string_view bytes, bool final, std::string* out) {
  size_t pos = 0;
  size_t run_start = 0;  // start of the valid bytes not yet appended
  while (pos < bytes.size()) {
    const LeadInfo info = Lead(static_cast<unsigned char>(bytes[pos]));
    if (info.length == 1) {
      ++pos;
      continue;
    }
    const int n = info.length == 0 ? 1 : ValidPrefix(bytes, pos, info);
    if (info.length != 0 && n == info.length) {
      pos += n;
      continue;
    }
    if (info.length != 0 && pos + n == bytes.size() && !final) break;  // may still complete
    out->append(bytes.data() + run_start, pos - run_start);
    out->append(kReplacement.data(), kReplacement.size());
    pos += n;
    run_start = pos;
  }
  out->append(bytes.data() + run_start, pos - run_start);
  return pos;
}

bool IsValidUtf8(absl::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const LeadInfo info = Lead(static_cast<unsigned char>(text[pos]));
    if (info.length == 0) return false;
    if (info.length > 1 && ValidPrefix(text, pos, info) != info.length) return false;
    pos += info.length;
  }
  return true;
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) AppendTokenBytes(id, skip_special, &bytes);
  std::string text;
  text.reserve(bytes.size());
  AppendUtf8Lossy(StripDecodedStart(bytes), /*final=*/true, &text);
  return text;
}

absl::string_view Tokenizer::StripDecodedStart(absl::string_view text) const {
  size_t strip = 0;
  while (strip < text.size() && static_cast<int>(strip) < leading_spaces_stripped() &&
         text[strip] == ' ') {
    ++strip;
  }
  return text.substr(strip);
}

std::unique_ptr<Tokenizer> NewByteTokenizer() { return std::make_unique<ByteTokenizerAdapter>(); }

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir) {
  const std::string hf_path = absl::StrCat(model_dir, "/tokenizer.json");
  if (FileExists(hf_path)) {
    FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<HfTokenizer> hf, HfTokenizer::FromFile(hf_path));
    return std::unique_ptr<Tokenizer>(std::move(hf));
  }
  const std::string spm_path = absl::StrCat(model_dir, "/tokenizer.model");
  if (FileExists(spm_path)) {
    FLUXION_ASSIGN_OR_RETURN(const std::string bytes,
                             ReadFileBounded(spm_path, kMaxSentencePieceModelBytes));
    absl::StatusOr<nlohmann::json> converted = SentencePieceToTokenizerJson(bytes);
    absl::StatusOr<std::unique_ptr<HfTokenizer>> hf =
        converted.ok() ? HfTokenizer::FromJson(converted->dump()) : converted.status();
    if (!hf.ok()) {
      return absl::Status(hf.status().code(), absl::StrCat(spm_path, ": ", hf.status().message()));
    }
    return std::unique_ptr<Tokenizer>(std::move(*hf));
  }
  const std::string config_path = absl::StrCat(model_dir, "/config.json");
  absl::StatusOr<ModelConfig> config = LoadModelConfig(config_path);
  if (absl::IsNotFound(config.status())) {
    return absl::FailedPreconditionError(
        absl::StrCat(model_dir, " has neither tokenizer.json, tokenizer.model nor config.json: no tokenizer"));
  }
  if (!config.ok()) return config.status();
  // Our byte-level models (docs/TASKS.md) say so only through their vocabulary: 256 bytes and the
  // three specials at the ids ByteTokenizer uses.
  const bool byte_model = config->vocab_size == ByteTokenizer::kVocabSize &&
                          config->bos_token_id == ByteTokenizer::kBos &&
                          config->eos_token_ids.size() == 1 &&
                          config->eos_token_ids[0] == ByteTokenizer::kEos;
  if (!byte_model) {
    return absl::FailedPreconditionError(absl::StrCat(
        model_dir, " has no tokenizer.json and its config.json (vocab_size ", config->vocab_size,
        ", bos_token_id ", config->bos_token_id,
        ") is not a Fluxion byte-level model (vocab_size 264, bos 256, eos 257): copy the "
        "model's tokenizer.json (or tokenizer.model) into the directory"));
  }
  return NewByteTokenizer();
}

}  // namespace fluxion::model
