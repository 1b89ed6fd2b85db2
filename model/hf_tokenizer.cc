#include "model/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fcntl.h>
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "model/json_text.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {

using Json = nlohmann::json;

namespace {

absl::Status FieldError(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: '", field, "' ", problem));
}

// GPT-2's byte <-> character map ("bytes_to_unicode"): printable Latin-1 bytes stand for
// themselves, the other 68 bytes for U+0100.. in byte order, so every byte is one visible char.
struct ByteLevelMap {
  std::array<std::string, 256> byte_to_utf8;
  std::array<int, 324> char_to_byte;  // by code point (all are < 0x144); -1: not in the map

  ByteLevelMap() {
    char_to_byte.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const int cp = printable ? b : next++;
      char_to_byte[cp] = b;
      std::string utf8;
      if (cp < 0x80) {
        utf8.push_back(static_cast<char>(cp));
      } else {
        utf8.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        utf8.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      byte_to_utf8[b] = std::move(utf8);
    }
  }
};

const ByteLevelMap& ByteMap() {
  static const ByteLevelMap* map = new ByteLevelMap();
  return *map;
}

// HF's ByteLevel decoder on one token: its characters mapped back to bytes when every one is in
// the map, else the token's own UTF-8 (an added token such as "<think> " that is not byte-level).
// `mapped` (optional) tells which.
std::string ByteLevelDecode(absl::string_view spelling, bool* mapped = nullptr) {
  if (mapped != nullptr) *mapped = false;
  const ByteLevelMap& map = ByteMap();
  std::string bytes;
  size_t i = 0;
  while (i < spelling.size()) {
    const auto b0 = static_cast<unsigned char>(spelling[i]);
    int cp;
    if (b0 < 0x80) {
      cp = b0;
      i += 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < spelling.size()) {
      cp = ((b0 & 0x1F) << 6) | (static_cast<unsigned char>(spelling[i + 1]) & 0x3F);
      i += 2;
    } else {
      return std::string(spelling);  // three bytes or more: beyond the map
    }
    if (cp >= static_cast<int>(map.char_to_byte.size()) || map.char_to_byte[cp] < 0) {
      return std::string(spelling);
    }
    bytes.push_back(static_cast<char>(map.char_to_byte[cp]));
  }
  if (mapped != nullptr) *mapped = true;
  return bytes;
}


// Absent and null read alike ("not given"), as HF's serde defaults do.
const Json* Find(const Json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<const Json*> RequiredObject(const Json& parent, const char* key,
                                           const std::string& field) {
  const Json* value = Find(parent, key);
  if (value == nullptr) return FieldError(field, "is required");
  if (!value->is_object()) {
    return FieldError(field, absl::StrCat("must be an object, got ", value->type_name()));
  }
  return value;
}

absl::StatusOr<bool> OptionalBool(const Json& object, const char* key, bool default_value,
                                  const std::string& prefix) {
  const Json* value = Find(object, key);
  if (value == nullptr) return default_value;
  if (!value->is_boolean()) {
    return FieldError(absl::StrCat(prefix, key),
                      absl::StrCat("must be a boolean, got ", value->type_name()));
  }
  return value->get<bool>();
}

absl::StatusOr<std::optional<std::string>> OptionalString(const Json& object, const char* key,
                                                          const std::string& prefix) {
  const Json* value = Find(object, key);
  if (value == nullptr) return std::optional<std::string>();
  if (!value->is_string()) {
    return FieldError(absl::StrCat(prefix, key),
                      absl::StrCat("must be a string, got ", value->type_name()));
  }
  return std::optional<std::string>(value->get<std::string>());
}

absl::StatusOr<std::string> RequiredType(const Json& object, const std::string& prefix) {
  FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> type, OptionalString(object, "type", prefix));
  if (!type.has_value()) return FieldError(absl::StrCat(prefix, "type"), "is required");
  return *type;
}

absl::StatusOr<int32_t> TokenId(const Json& value, const std::string& field) {
  if (!value.is_number_integer()) {
    return FieldError(field, absl::StrCat("must be an integer id, got ", value.type_name()));
  }
  if (value.is_number_unsigned()
          ? value.get<uint64_t>() >= uint64_t{kMaxTokenizerVocab}
          : (value.get<int64_t>() < 0 || value.get<int64_t>() >= kMaxTokenizerVocab)) {
    return FieldError(
        field, absl::StrCat("(", value.dump(), ") is outside [0, ", kMaxTokenizerVocab, ")"));
  }
  return static_cast<int32_t>(value.get<int64_t>());
}

absl::Status CheckSpelling(absl::string_view spelling, const std::string& field) {
  if (spelling.empty()) return FieldError(field, "is an empty token");
  if (spelling.size() > kMaxTokenBytes) {
    return FieldError(field, absl::StrCat("is a token of ", spelling.size(),
                                          " bytes, above the limit of ", kMaxTokenBytes));
  }
  return absl::OkStatus();
}

// Unicode White_Space (Rust's char::is_whitespace, which HF's \s* around added tokens means).
bool IsWhiteSpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// The code point at `pos` of valid UTF-8 `text` and its length.
uint32_t CodePointAt(absl::string_view text, size_t pos, size_t* length) {
  const auto b0 = static_cast<unsigned char>(text[pos]);
  const size_t n = b0 < 0x80 ? 1 : b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4;
  uint32_t cp = n == 1 ? b0 : n == 2 ? (b0 & 0x1F) : n == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (size_t k = 1; k < n; ++k) {
    cp = (cp << 6) | (static_cast<unsigned char>(text[pos + k]) & 0x3F);
  }
  *length = n;
  return cp;
}

// Whether `text` is exactly one valid UTF-8 character.
bool IsOneCharacter(absl::string_view text) {
  if (text.empty() || !IsValidUtf8(text)) return false;
  size_t length = 0;
  CodePointAt(text, 0, &length);
  return length == text.size();
}

// Bytes of whitespace at the start / end of valid UTF-8 `text`.
size_t LeadingWhitespace(absl::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t n = 0;
    if (!IsWhiteSpace(CodePointAt(text, pos, &n))) break;
    pos += n;
  }
  return pos;
}
size_t TrailingWhitespace(absl::string_view text) {
  size_t end = text.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    size_t n = 0;
    if (!IsWhiteSpace(CodePointAt(text, start, &n))) break;
    end = start;
  }
  return text.size() - end;
}

bool IsAscii(absl::string_view text) {
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

absl::StatusOr<std::string> Nfc(absl::string_view text) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status)) {
    return absl::InternalError(absl::StrCat("ICU NFC normalizer: ", u_errorName(status)));
  }
  std::string out;
  icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(text.size()));
  nfc->normalizeUTF8(0, icu::StringPiece(text.data(), static_cast<int32_t>(text.size())), sink,
                     nullptr, status);
  if (U_FAILURE(status)) {
    return absl::InvalidArgumentError(absl::StrCat("NFC normalization: ", u_errorName(status)));
  }
  return out;
}

// SentencePiece's byte token for `b` ("<0x0A>"), what byte_fallback falls back to.
std::string ByteFallbackSpelling(int b) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  return absl::StrCat("<0x", std::string(1, kHex[b >> 4]), std::string(1, kHex[b & 15]), ">");
}

// The byte a <0xXX> token stands for, or -1.
int ByteFallbackByte(absl::string_view spelling) {
  if (spelling.size() != 6 || !absl::StartsWith(spelling, "<0x") || spelling[5] != '>') return -1;
  int value = 0;
  for (char c : spelling.substr(3, 2)) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

// A literal Replace's `pattern.String` and `content`.
absl::StatusOr<std::pair<std::string, std::string>> LiteralReplace(const Json& step,
                                                                   const std::string& prefix) {
  FLUXION_ASSIGN_OR_RETURN(const Json* pattern,
                           RequiredObject(step, "pattern", absl::StrCat(prefix, "pattern")));
  FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> from,
                           OptionalString(*pattern, "String", absl::StrCat(prefix, "pattern.")));
  if (!from.has_value() || from->empty()) {
    return FieldError(absl::StrCat(prefix, "pattern"),
                      "must hold a non-empty 'String' (Regex replacements are not supported)");
  }
  FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> to, OptionalString(step, "content", prefix));
  if (!to.has_value()) return FieldError(absl::StrCat(prefix, "content"), "is required");
  return std::make_pair(*std::move(from), *std::move(to));
}

// GPT-2's pre-tokenizer pattern: what ByteLevel with use_regex=true splits by.
constexpr absl::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

// Runs the caller's EncodeCheck after about every kUnits units of work (a byte or added-token
// candidate scanned, a byte merged; a regex match counts as kUnits / 64, since one may take up to
// the match limit's steps), so that a deadline is noticed within a bounded amount of work (tens
// of milliseconds) while checking costs nothing measurable.
class HfTokenizer::WorkCheck {
 public:
  explicit WorkCheck(const EncodeCheck& check) : check_(check) {}

  absl::Status Add(size_t units) {
    if (!check_) return absl::OkStatus();
    done_ += units;
    if (done_ < kUnits) return absl::OkStatus();
    return Now();
  }
  absl::Status Now() {
    done_ = 0;
    return check_ ? check_() : absl::OkStatus();
  }

  static constexpr size_t kUnits = size_t{1} << 16;
  static constexpr size_t kRegexMatch = kUnits / 64;

 private:
  const EncodeCheck& check_;
  size_t done_ = 0;
};

// One Split pre-tokenizer (behavior Isolated, invert false): every match is a piece and so is
// every stretch between matches. UTF + UCP mode so \s, \p{L}, \p{N} and (?i) are Unicode-aware,
// as in Oniguruma, which HF uses for these patterns.
class HfTokenizer::Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(absl::string_view pattern, bool literal,
                                                        const std::string& field) {
    if (pattern.empty()) return FieldError(field, "is an empty pattern");
    if (pattern.size() > kMaxPreTokenizerPatternBytes) {
      return FieldError(
          field, absl::StrCat("is a pattern of ", pattern.size(), " bytes, above the limit of ",
                              kMaxPreTokenizerPatternBytes));
    }
    int error = 0;
    PCRE2_SIZE offset = 0;
    // PCRE2_LITERAL allows no UCP (nothing in a literal is a class).
    const uint32_t options = literal ? PCRE2_UTF | PCRE2_LITERAL : PCRE2_UTF | PCRE2_UCP;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     options, &error, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      return FieldError(field, absl::StrCat("does not compile at offset ", offset, ": ",
                                            reinterpret_cast<const char*>(message)));
    }
    // The JIT is several times faster; without it (unsupported CPU) the interpreter still works.
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    // A hostile pattern can backtrack exponentially; HF's patterns take a few steps per match.
    pcre2_match_context* context = pcre2_match_context_create(nullptr);
    if (context == nullptr) {
      pcre2_code_free(code);
      return absl::ResourceExhaustedError("pre-tokenizer: out of memory");
    }
    pcre2_set_match_limit(context, kMatchLimit);
    return std::unique_ptr<Regex>(new Regex(code, context));
  }

  ~Regex() {
    pcre2_match_context_free(context_);
    pcre2_code_free(code_);
  }

  // Appends the pieces of `text` (valid UTF-8) to `out`.
  absl::Status Split(absl::string_view text, std::vector<absl::string_view>* out,
                     WorkCheck* work) const {
    pcre2_match_data* match = pcre2_match_data_create_from_pattern(code_, nullptr);
    if (match == nullptr) return absl::ResourceExhaustedError("pre-tokenizer: out of memory");
    absl::Status status = SplitWith(text, match, out, work);
    pcre2_match_data_free(match);
    return status;
  }

 private:
  static constexpr uint32_t kMatchLimit = 1'000'000;

  // A limit hit is a property of this text with this pattern, the same on every try: a
  // permanent InvalidArgument (HTTP 400), not "try later". Anything else is the library's.
  static absl::Status MatchError(int rc, size_t size, size_t offset) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof(message));
    const char* why = reinterpret_cast<const char*>(message);
    if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT ||
        rc == PCRE2_ERROR_HEAPLIMIT) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the tokenizer's pre-tokenizer regex cannot split this text: at byte ", offset, " of a ",
          size, "-byte piece it gave up after ", kMatchLimit, " steps (", why,
          "); the pattern backtracks too much on this input: change or shorten the text"));
    }
    if (rc == PCRE2_ERROR_NOMEMORY) {
      return absl::ResourceExhaustedError("pre-tokenizer: out of memory");
    }
    return absl::InternalError(
        absl::StrCat("pre-tokenizer regex failed on a text of ", size, " bytes: ", why));
  }

  // The context is only read by pcre2_match, so concurrent Splits may share it.
  Regex(pcre2_code* code, pcre2_match_context* context) : code_(code), context_(context) {}

  absl::Status SplitWith(absl::string_view text, pcre2_match_data* match,
                         std::vector<absl::string_view>* out, WorkCheck* work) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t offset = 0;
    size_t last = 0;  // end of the previous piece
    while (offset <= text.size()) {
      int rc =
          pcre2_match(code_, subject, text.size(), offset, PCRE2_NO_UTF_CHECK, match, context_);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {  // a very long run: the interpreter uses the heap
        rc = pcre2_match(code_, subject, text.size(), offset, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                         match, context_);
      }
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) return MatchError(rc, text.size(), offset);
      if (absl::Status s = work->Add(WorkCheck::kRegexMatch); !s.ok()) return s;
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
      const size_t start = ovector[0];
      const size_t end = ovector[1];
      if (start > last) out->push_back(text.substr(last, start - last));
      if (end > start) {
        out->push_back(text.substr(start, end - start));
        last = end;
        offset = end;
      } else {  // an empty match: step over one character
        if (end >= text.size()) break;
        offset = end + 1;
        while (offset < text.size() && (static_cast<unsigned char>(text[offset]) & 0xC0) == 0x80) {
          ++offset;
        }
      }
    }
    if (last < text.size()) out->push_back(text.substr(last));
    return absl::OkStatus();
  }

  pcre2_code* code_;
  pcre2_match_context* context_;
};

// Builds an HfTokenizer from a parsed tokenizer.json, checking every field before use.
class HfTokenizerLoader {
 public:
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> Load(const Json& root) {
    if (!root.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json must hold an object, got ", root.type_name()));
    }
    std::unique_ptr<HfTokenizer> t(new HfTokenizer());
    FLUXION_ASSIGN_OR_RETURN(const Json* model, RequiredObject(root, "model", "model"));
    FLUXION_RETURN_IF_ERROR(LoadModel(*model, t.get()));
    FLUXION_RETURN_IF_ERROR(LoadNormalizer(root, t.get()));  // before the added tokens: NFC
    FLUXION_RETURN_IF_ERROR(LoadAdded(root, t.get()));
    bool byte_level_pre = false;
    FLUXION_RETURN_IF_ERROR(LoadPreTokenizer(root, t.get(), &byte_level_pre));
    FLUXION_RETURN_IF_ERROR(LoadDecoder(root, t.get()));
    // Symbols start as bytes exactly when the decoder maps byte-level characters back to bytes;
    // a ByteLevel pre-tokenizer without that decoder (or byte fallback with it) would encode
    // text into symbols its decoding cannot give back.
    if (byte_level_pre && !t->byte_level_) {
      return FieldError("decoder.type", "must be ByteLevel with a ByteLevel pre-tokenizer");
    }
    if (t->byte_level_ && t->byte_fallback_) {
      return FieldError("model.byte_fallback",
                        "is true with a ByteLevel decoder, which is not supported");
    }
    if (t->byte_level_ && t->metaspace_.has_value()) {
      return FieldError("decoder.type", "is ByteLevel with a Metaspace pre-tokenizer");
    }
    return t;
  }

 private:
  static absl::Status LoadModel(const Json& model, HfTokenizer* t) {
    FLUXION_ASSIGN_OR_RETURN(std::string type, RequiredType(model, "model."));
    if (type != "BPE") {
      return FieldError("model.type", absl::StrCat("is '", type, "'; only BPE is supported"));
    }
    if (const Json* dropout = Find(model, "dropout");
        dropout != nullptr && !(dropout->is_number() && dropout->get<double>() == 0.0)) {
      return FieldError("model.dropout", "is set; only deterministic BPE (null) is supported");
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> affix,
                               OptionalString(model, key, "model."));
      if (affix.has_value() && !affix->empty()) {
        return FieldError(absl::StrCat("model.", key), "is set, which is not supported");
      }
    }
    FLUXION_ASSIGN_OR_RETURN(t->byte_fallback_,
                             OptionalBool(model, "byte_fallback", false, "model."));
    FLUXION_ASSIGN_OR_RETURN(t->fuse_unk_, OptionalBool(model, "fuse_unk", false, "model."));
    FLUXION_ASSIGN_OR_RETURN(t->ignore_merges_,
                             OptionalBool(model, "ignore_merges", false, "model."));
    FLUXION_RETURN_IF_ERROR(LoadVocab(model, t));
    FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> unk,
                             OptionalString(model, "unk_token", "model."));
    if (unk.has_value()) {
      auto it = t->spelling_to_id_.find(*unk);
      if (it == t->spelling_to_id_.end()) {
        return FieldError("model.unk_token", absl::StrCat("('", *unk, "') is not in the vocab"));
      }
      t->unk_id_ = it->second;
    }
    return LoadMerges(model, t);
  }

  static absl::Status LoadVocab(const Json& model, HfTokenizer* t) {
    FLUXION_ASSIGN_OR_RETURN(const Json* vocab, RequiredObject(model, "vocab", "model.vocab"));
    if (vocab->size() > static_cast<size_t>(kMaxTokenizerVocab)) {
      return FieldError(
          "model.vocab",
          absl::StrCat("has ", vocab->size(), " tokens, above the limit of ", kMaxTokenizerVocab));
    }
    int32_t max_id = -1;
    for (auto it = vocab->begin(); it != vocab->end(); ++it) {
      const std::string field = absl::StrCat("model.vocab[\"", it.key(), "\"]");
      FLUXION_RETURN_IF_ERROR(CheckSpelling(it.key(), field));
      FLUXION_ASSIGN_OR_RETURN(int32_t id, TokenId(it.value(), field));
      max_id = std::max(max_id, id);
    }
    t->tokens_.resize(static_cast<size_t>(max_id + 1));
    t->spelling_to_id_.reserve(vocab->size());
    t->bytes_to_id_.reserve(vocab->size());
    for (auto it = vocab->begin(); it != vocab->end(); ++it) {
      const int32_t id = static_cast<int32_t>(it.value().get<int64_t>());
      HfTokenizer::Token& token = t->tokens_[id];
      if (token.present) {
        return FieldError(absl::StrCat("model.vocab[\"", it.key(), "\"]"),
                          absl::StrCat("reuses id ", id, " of '", token.spelling, "'"));
      }
      token.present = true;
      token.spelling = it.key();
      bool mapped = false;
      token.bytes = ByteLevelDecode(token.spelling, &mapped);
      t->spelling_to_id_.emplace(token.spelling, id);
      // ignore_merges looks pre-tokens up by their byte-level spelling, which only a fully
      // mapped token has.
      if (mapped) t->bytes_to_id_.emplace(token.bytes, id);
    }
    t->byte_id_.fill(-1);
    t->byte_fallback_id_.fill(-1);
    const ByteLevelMap& map = ByteMap();
    for (int b = 0; b < 256; ++b) {
      auto it = t->spelling_to_id_.find(map.byte_to_utf8[b]);
      if (it != t->spelling_to_id_.end()) t->byte_id_[b] = it->second;
      it = t->spelling_to_id_.find(ByteFallbackSpelling(b));
      if (it != t->spelling_to_id_.end()) t->byte_fallback_id_[b] = it->second;
    }
    // Character-level BPE starts from the vocabulary's single characters (valid UTF-8 only: a
    // spelling that is not cannot match a character of valid input).
    for (const auto& [spelling, id] : t->spelling_to_id_) {
      size_t length = 0;
      if (IsOneCharacter(spelling)) t->char_id_.emplace(CodePointAt(spelling, 0, &length), id);
    }
    return absl::OkStatus();
  }

  // One merge's two parts: "a b" (split at the one space; byte-level tokens hold no space) or
  // ["a", "b"] (tokenizers >= 0.20).
  static absl::StatusOr<std::pair<std::string, std::string>> MergeParts(const Json& merge,
                                                                        const std::string& f) {
    if (merge.is_string()) {
      const std::string& s = merge.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return FieldError(f, absl::StrCat("('", s.substr(0, 64), "') is not two tokens 'a b'"));
      }
      return std::make_pair(s.substr(0, space), s.substr(space + 1));
    }
    if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      return std::make_pair(merge[0].get<std::string>(), merge[1].get<std::string>());
    }
    return FieldError(f, absl::StrCat("must be a string 'a b' or a pair [\"a\", \"b\"], got ",
                                      merge.type_name()));
  }

  static absl::Status LoadMerges(const Json& model, HfTokenizer* t) {
    const Json* merges = Find(model, "merges");
    if (merges == nullptr) return absl::OkStatus();
    if (!merges->is_array()) {
      return FieldError("model.merges",
                        absl::StrCat("must be an array, got ", merges->type_name()));
    }
    if (merges->size() > static_cast<size_t>(kMaxTokenizerMerges)) {
      return FieldError("model.merges",
                        absl::StrCat("has ", merges->size(), " entries, above the limit of ",
                                     kMaxTokenizerMerges));
    }
    t->merges_.reserve(merges->size());
    for (size_t i = 0; i < merges->size(); ++i) {
      const std::string field = absl::StrCat("model.merges[", i, "]");
      FLUXION_ASSIGN_OR_RETURN(auto parts, MergeParts((*merges)[i], field));
      auto left = t->spelling_to_id_.find(parts.first);
      auto right = t->spelling_to_id_.find(parts.second);
      auto merged = t->spelling_to_id_.find(absl::StrCat(parts.first, parts.second));
      if (left == t->spelling_to_id_.end() || right == t->spelling_to_id_.end() ||
          merged == t->spelling_to_id_.end()) {
        return FieldError(field, absl::StrCat("('", parts.first.substr(0, 64), "' + '",
                                              parts.second.substr(0, 64),
                                              "') names a token missing from model.vocab"));
      }
      const uint64_t key =
          (static_cast<uint64_t>(left->second) << 32) | static_cast<uint32_t>(right->second);
      // A repeated pair keeps its last rank, as HF's map built from the list does.
      t->merges_.insert_or_assign(key, HfTokenizer::Merge{static_cast<int32_t>(i), merged->second});
    }
    return absl::OkStatus();
  }

  static absl::Status LoadAdded(const Json& root, HfTokenizer* t) {
    const Json* added = Find(root, "added_tokens");
    if (added == nullptr) return absl::OkStatus();
    if (!added->is_array()) {
      return FieldError("added_tokens", absl::StrCat("must be an array, got ", added->type_name()));
    }
    if (added->size() > static_cast<size_t>(kMaxTokenizerVocab)) {
      return FieldError(
          "added_tokens",
          absl::StrCat("has ", added->size(), " entries, above the limit of ", kMaxTokenizerVocab));
    }
    for (size_t i = 0; i < added->size(); ++i) {
      const std::string prefix = absl::StrCat("added_tokens[", i, "].");
      const Json& entry = (*added)[i];
      if (!entry.is_object()) {
        return FieldError(absl::StrCat("added_tokens[", i, "]"),
                          absl::StrCat("must be an object, got ", entry.type_name()));
      }
      HfTokenizer::AddedToken token;
      const Json* id = Find(entry, "id");
      if (id == nullptr) return FieldError(absl::StrCat(prefix, "id"), "is required");
      FLUXION_ASSIGN_OR_RETURN(token.id, TokenId(*id, absl::StrCat(prefix, "id")));
      FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> content,
                               OptionalString(entry, "content", prefix));
      if (!content.has_value()) return FieldError(absl::StrCat(prefix, "content"), "is required");
      FLUXION_RETURN_IF_ERROR(CheckSpelling(*content, absl::StrCat(prefix, "content")));
      token.content = std::move(*content);
      FLUXION_ASSIGN_OR_RETURN(token.special, OptionalBool(entry, "special", false, prefix));
      FLUXION_ASSIGN_OR_RETURN(token.lstrip, OptionalBool(entry, "lstrip", false, prefix));
      FLUXION_ASSIGN_OR_RETURN(token.rstrip, OptionalBool(entry, "rstrip", false, prefix));
      FLUXION_ASSIGN_OR_RETURN(token.normalized,
                               OptionalBool(entry, "normalized", !token.special, prefix));
      FLUXION_ASSIGN_OR_RETURN(bool single_word, OptionalBool(entry, "single_word", false, prefix));
      if (single_word) {
        return FieldError(absl::StrCat(prefix, "single_word"), "is true, which is not supported");
      }
      // HF gives a token already in the model vocab that token's id (and warns when the file says
      // otherwise); a file that disagrees with itself is refused rather than guessed at.
      if (auto known = t->spelling_to_id_.find(token.content); known != t->spelling_to_id_.end()) {
        const HfTokenizer::Token& other = t->tokens_[known->second];
        if (other.added) {
          return FieldError(absl::StrCat(prefix, "content"),
                            absl::StrCat("('", token.content, "') repeats an earlier added token"));
        }
        if (known->second != token.id) {
          return FieldError(absl::StrCat(prefix, "id"),
                            absl::StrCat("(", token.id, ") disagrees with model.vocab, which ",
                                         "gives '", token.content, "' id ", known->second));
        }
      }
      // A normalized token matches, and decodes, as its normalized form (HF's normalized_cache).
      token.match_content = token.content;
      if (token.normalized && !t->normalizers_.empty()) {
        std::string storage;
        FLUXION_ASSIGN_OR_RETURN(absl::string_view normalized,
                                 t->Normalize(token.content, &storage));
        token.match_content = std::string(normalized);
        if (token.match_content.empty()) {
          return FieldError(absl::StrCat(prefix, "content"), "normalizes to nothing");
        }
      }
      if (static_cast<size_t>(token.id) >= t->tokens_.size()) {
        t->tokens_.resize(static_cast<size_t>(token.id) + 1);
      }
      // An added token's id may also be in the model vocab; HF's id -> token asks the added
      // vocabulary first, so its spelling wins here too.
      HfTokenizer::Token& entry_token = t->tokens_[token.id];
      entry_token.present = true;
      entry_token.added = true;
      entry_token.special = token.special;
      entry_token.spelling = token.content;
      entry_token.bytes = ByteLevelDecode(token.match_content);
      t->spelling_to_id_.insert_or_assign(token.content, token.id);
      t->added_.push_back(std::move(token));
    }
    BuildMatcher(*t, /*normalized=*/false, &t->raw_added_);
    BuildMatcher(*t, /*normalized=*/true, &t->normalized_added_);
    return absl::OkStatus();
  }

  static void BuildMatcher(const HfTokenizer& t, bool normalized,
                           HfTokenizer::AddedMatcher* matcher) {
    for (size_t i = 0; i < t.added_.size(); ++i) {
      // Two passes even without a normalizer, as HF: the first cuts out the normalized=false
      // tokens, the second finds the others in what is left (an overlap can differ from one pass).
      if (t.added_[i].normalized != normalized) continue;
      matcher->by_first_byte[static_cast<unsigned char>(t.added_[i].match_content[0])].push_back(
          static_cast<int>(i));
      matcher->empty = false;
    }
    for (auto& bucket : matcher->by_first_byte) {
      std::stable_sort(bucket.begin(), bucket.end(), [&t](int a, int b) {
        return t.added_[a].match_content.size() > t.added_[b].match_content.size();
      });
    }
  }

  // One normalizer: NFC, Prepend or a literal Replace (the SentencePiece-style files' spaces).
  static absl::Status LoadNormalizerStep(const Json& step, const std::string& prefix,
                                         HfTokenizer* t) {
    if (!step.is_object()) return FieldError(prefix, "must be an object");
    FLUXION_ASSIGN_OR_RETURN(std::string type, RequiredType(step, absl::StrCat(prefix, ".")));
    HfTokenizer::NormalizerStep n{HfTokenizer::NormalizerStep::kNfc, "", ""};
    if (type == "NFC") {
      t->nfc_ = true;
    } else if (type == "Prepend") {
      FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> prepend,
                               OptionalString(step, "prepend", absl::StrCat(prefix, ".")));
      if (!prepend.has_value()) return FieldError(absl::StrCat(prefix, ".prepend"), "is required");
      n = {HfTokenizer::NormalizerStep::kPrepend, "", *std::move(prepend)};
    } else if (type == "Replace") {
      FLUXION_ASSIGN_OR_RETURN(auto replace, LiteralReplace(step, absl::StrCat(prefix, ".")));
      n = {HfTokenizer::NormalizerStep::kReplace, std::move(replace.first),
           std::move(replace.second)};
    } else {
      return FieldError(absl::StrCat(prefix, ".type"),
                        absl::StrCat("is '", type, "'; only NFC, Prepend and Replace are supported"));
    }
    t->normalizers_.push_back(std::move(n));
    return absl::OkStatus();
  }

  static absl::Status LoadNormalizer(const Json& root, HfTokenizer* t) {
    const Json* normalizer = Find(root, "normalizer");
    if (normalizer == nullptr) return absl::OkStatus();
    if (!normalizer->is_object()) {
      return FieldError("normalizer",
                        absl::StrCat("must be an object or null, got ", normalizer->type_name()));
    }
    FLUXION_ASSIGN_OR_RETURN(std::string type, RequiredType(*normalizer, "normalizer."));
    if (type != "Sequence") return LoadNormalizerStep(*normalizer, "normalizer", t);
    const Json* list = Find(*normalizer, "normalizers");
    if (list == nullptr || !list->is_array()) {
      return FieldError("normalizer.normalizers", "must be an array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      FLUXION_RETURN_IF_ERROR(
          LoadNormalizerStep((*list)[i], absl::StrCat("normalizer.normalizers[", i, "]"), t));
    }
    return absl::OkStatus();
  }

  static absl::Status LoadSplit(const Json& split, const std::string& prefix, HfTokenizer* t) {
    FLUXION_ASSIGN_OR_RETURN(const Json* pattern,
                             RequiredObject(split, "pattern", absl::StrCat(prefix, "pattern")));
    FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> regex,
                             OptionalString(*pattern, "Regex", absl::StrCat(prefix, "pattern.")));
    FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> literal,
                             OptionalString(*pattern, "String", absl::StrCat(prefix, "pattern.")));
    if (regex.has_value() == literal.has_value()) {
      return FieldError(absl::StrCat(prefix, "pattern"), "must hold one of 'Regex' or 'String'");
    }
    FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> behavior,
                             OptionalString(split, "behavior", prefix));
    if (behavior.value_or("") != "Isolated") {
      return FieldError(
          absl::StrCat(prefix, "behavior"),
          absl::StrCat("is '", behavior.value_or(""), "'; only Isolated is supported"));
    }
    FLUXION_ASSIGN_OR_RETURN(bool invert, OptionalBool(split, "invert", false, prefix));
    if (invert) return FieldError(absl::StrCat(prefix, "invert"), "is true; not supported");
    const std::string field = absl::StrCat(prefix, "pattern.", regex ? "Regex" : "String");
    FLUXION_ASSIGN_OR_RETURN(
        std::unique_ptr<HfTokenizer::Regex> compiled,
        HfTokenizer::Regex::Compile(regex ? *regex : *literal, !regex.has_value(), field));
    t->splits_.push_back(std::move(compiled));
    return absl::OkStatus();
  }

  static absl::Status LoadByteLevel(const Json& byte_level, const std::string& prefix,
                                    HfTokenizer* t) {
    FLUXION_ASSIGN_OR_RETURN(t->add_prefix_space_,
                             OptionalBool(byte_level, "add_prefix_space", true, prefix));
    t->byte_level_step_ = t->splits_.size();
    FLUXION_ASSIGN_OR_RETURN(bool use_regex, OptionalBool(byte_level, "use_regex", true, prefix));
    if (use_regex) {
      FLUXION_ASSIGN_OR_RETURN(std::unique_ptr<HfTokenizer::Regex> gpt2,
                               HfTokenizer::Regex::Compile(kGpt2Pattern, false, prefix));
      t->splits_.push_back(std::move(gpt2));
    }
    return absl::OkStatus();
  }

  static absl::Status LoadMetaspace(const Json& metaspace, const std::string& prefix,
                                    HfTokenizer::Metaspace* out) {
    FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> replacement,
                             OptionalString(metaspace, "replacement", prefix));
    out->replacement = replacement.value_or("\xE2\x96\x81");  // U+2581, SentencePiece's
    if (!IsOneCharacter(out->replacement)) {
      return FieldError(absl::StrCat(prefix, "replacement"), "must be one character");
    }
    FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> scheme,
                             OptionalString(metaspace, "prepend_scheme", prefix));
    if (scheme.has_value()) {
      if (*scheme == "always") {
        out->prepend = HfTokenizer::Metaspace::kAlways;
      } else if (*scheme == "first") {
        out->prepend = HfTokenizer::Metaspace::kFirst;
      } else if (*scheme == "never") {
        out->prepend = HfTokenizer::Metaspace::kNever;
      } else {
        return FieldError(absl::StrCat(prefix, "prepend_scheme"),
                          absl::StrCat("is '", *scheme, "'; not always, first or never"));
      }
    } else {  // files written before tokenizers 0.14
      FLUXION_ASSIGN_OR_RETURN(bool add_prefix_space,
                               OptionalBool(metaspace, "add_prefix_space", true, prefix));
      out->prepend = add_prefix_space ? HfTokenizer::Metaspace::kAlways
                                      : HfTokenizer::Metaspace::kNever;
    }
    FLUXION_ASSIGN_OR_RETURN(out->split, OptionalBool(metaspace, "split", true, prefix));
    return absl::OkStatus();
  }

  // `byte_level` tells whether the pre-tokenizer has a ByteLevel step.
  static absl::Status LoadPreTokenizer(const Json& root, HfTokenizer* t, bool* byte_level) {
    const Json* pre = Find(root, "pre_tokenizer");
    if (pre == nullptr) return absl::OkStatus();  // each piece is one pre-token
    if (!pre->is_object()) {
      return FieldError("pre_tokenizer",
                        absl::StrCat("must be an object or null, got ", pre->type_name()));
    }
    FLUXION_ASSIGN_OR_RETURN(std::string type, RequiredType(*pre, "pre_tokenizer."));
    *byte_level = type == "ByteLevel";
    if (type == "ByteLevel") return LoadByteLevel(*pre, "pre_tokenizer.", t);
    if (type == "Metaspace") {
      HfTokenizer::Metaspace metaspace;
      FLUXION_RETURN_IF_ERROR(LoadMetaspace(*pre, "pre_tokenizer.", &metaspace));
      t->metaspace_ = std::move(metaspace);
      return absl::OkStatus();
    }
    if (type != "Sequence") {
      return FieldError("pre_tokenizer.type",
                        absl::StrCat("is '", type,
                                     "'; only ByteLevel, Metaspace or a Sequence of Split "
                                     "and a final ByteLevel is supported"));
    }
    const Json* list = Find(*pre, "pretokenizers");
    if (list == nullptr || !list->is_array() || list->empty()) {
      return FieldError("pre_tokenizer.pretokenizers", "must be a non-empty array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      const std::string prefix = absl::StrCat("pre_tokenizer.pretokenizers[", i, "].");
      const Json& step = (*list)[i];
      if (!step.is_object()) return FieldError(prefix, "must be an object");
      FLUXION_ASSIGN_OR_RETURN(std::string step_type, RequiredType(step, prefix));
      const bool last = i + 1 == list->size();
      if (step_type == "Split" && !last) {
        FLUXION_RETURN_IF_ERROR(LoadSplit(step, prefix, t));
      } else if (step_type == "ByteLevel" && last) {
        *byte_level = true;
        FLUXION_RETURN_IF_ERROR(LoadByteLevel(step, prefix, t));
      } else {
        return FieldError(absl::StrCat(prefix, "type"),
                          absl::StrCat("is '", step_type, "' at step ", i,
                                       "; only Split steps and a final ByteLevel are supported"));
      }
    }
    return absl::OkStatus();
  }

  // What the decoder makes of each token, for character-level BPE: literal replacements in
  // order, and <0xXX> tokens as their byte.
  struct TokenDecoding {
    std::vector<std::pair<std::string, std::string>> replaces;
    bool byte_fallback = false;
  };

  // One step of a SentencePiece-style decoder Sequence. `fused`: a Fuse came before (a Strip
  // then cuts the start of the whole text, which is what Decode applies).
  static absl::Status LoadDecoderStep(const Json& step, const std::string& prefix, bool* fused,
                                      TokenDecoding* decoding, HfTokenizer* t) {
    if (!step.is_object()) return FieldError(prefix, "must be an object");
    FLUXION_ASSIGN_OR_RETURN(std::string type, RequiredType(step, absl::StrCat(prefix, ".")));
    if (type == "Replace") {
      FLUXION_ASSIGN_OR_RETURN(auto replace, LiteralReplace(step, absl::StrCat(prefix, ".")));
      decoding->replaces.push_back(std::move(replace));
    } else if (type == "ByteFallback") {
      decoding->byte_fallback = true;
    } else if (type == "Fuse") {
      *fused = true;
    } else if (type == "Strip") {
      FLUXION_ASSIGN_OR_RETURN(std::optional<std::string> content,
                               OptionalString(step, "content", absl::StrCat(prefix, ".")));
      const Json* start = Find(step, "start");
      const Json* stop = Find(step, "stop");
      const bool stops = stop != nullptr && !(stop->is_number_integer() && stop->get<int64_t>() == 0);
      if (!*fused || content.value_or("") != " " || stops || start == nullptr ||
          !start->is_number_integer() || start->get<int64_t>() < 0 ||
          start->get<int64_t>() > 16) {
        return FieldError(prefix,
                          "is a Strip other than of up to 16 leading spaces after a Fuse");
      }
      t->decode_strip_ = static_cast<int>(start->get<int64_t>());
    } else {
      return FieldError(absl::StrCat(prefix, ".type"),
                        absl::StrCat("is '", type, "'; only Replace, ByteFallback, Fuse and "
                                     "Strip are supported in a decoder Sequence"));
    }
    return absl::OkStatus();
  }

  // Every token's bytes under `decoding` (the ByteLevel decoder's were set with the vocabulary).
  static void DecodeTokens(const TokenDecoding& decoding, HfTokenizer* t) {
    for (HfTokenizer::Token& token : t->tokens_) {
      if (!token.present) continue;
      const int byte = decoding.byte_fallback ? ByteFallbackByte(token.spelling) : -1;
      if (byte >= 0) {
        token.bytes = std::string(1, static_cast<char>(byte));
        continue;
      }
      token.bytes = token.spelling;
      for (const auto& [from, to] : decoding.replaces) {
        token.bytes = absl::StrReplaceAll(token.bytes, {{from, to}});
      }
    }
  }

  static absl::Status LoadDecoder(const Json& root, HfTokenizer* t) {
    FLUXION_ASSIGN_OR_RETURN(const Json* decoder, RequiredObject(root, "decoder", "decoder"));
    FLUXION_ASSIGN_OR_RETURN(std::string type, RequiredType(*decoder, "decoder."));
    if (type == "ByteLevel") return absl::OkStatus();
    t->byte_level_ = false;
    TokenDecoding decoding;
    if (type == "Metaspace") {
      HfTokenizer::Metaspace metaspace;
      FLUXION_RETURN_IF_ERROR(LoadMetaspace(*decoder, "decoder.", &metaspace));
      decoding.replaces.emplace_back(metaspace.replacement, " ");
      // HF's Metaspace decoder drops the first token's leading space unless it never prepends.
      t->decode_strip_ = metaspace.prepend == HfTokenizer::Metaspace::kNever ? 0 : 1;
    } else if (type == "Sequence") {
      const Json* list = Find(*decoder, "decoders");
      if (list == nullptr || !list->is_array()) {
        return FieldError("decoder.decoders", "must be an array");
      }
      bool fused = false;
      for (size_t i = 0; i < list->size(); ++i) {
        FLUXION_RETURN_IF_ERROR(LoadDecoderStep((*list)[i], absl::StrCat("decoder.decoders[", i, "]"),
                                                &fused, &decoding, t));
      }
    } else {
      return FieldError("decoder.type",
                        absl::StrCat("is '", type,
                                     "'; only ByteLevel, Metaspace or a Sequence of Replace, "
                                     "ByteFallback, Fuse and Strip is supported"));
    }
    DecodeTokens(decoding, t);
    return absl::OkStatus();
  }
};

HfTokenizer::HfTokenizer() {
  byte_id_.fill(-1);
  byte_fallback_id_.fill(-1);
}
HfTokenizer::~HfTokenizer() = default;

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::FromJson(absl::string_view json) {
  if (json.size() > kMaxTokenizerJsonBytes) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json of ", json.size(),
                                                   " bytes is above the limit of ",
                                                   kMaxTokenizerJsonBytes));
  }
  FLUXION_ASSIGN_OR_RETURN(Json root,
                           ParseJsonText(json, "tokenizer.json", {kMaxTokenizerJsonDepth, false}));
  return HfTokenizerLoader::Load(root);
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::FromFile(const std::string& path) {
  FLUXION_ASSIGN_OR_RETURN(const std::string contents,
                           ReadFileBounded(path, kMaxTokenizerJsonBytes));
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tokenizer = FromJson(contents);
  if (!tokenizer.ok()) {
    return absl::Status(tokenizer.status().code(),
                        absl::StrCat(path, ": ", tokenizer.status().message()));
  }
  return tokenizer;
}

absl::Status HfTokenizer::SplitOnAdded(absl::string_view text, const AddedMatcher& matcher,
                                       std::vector<Piece>* out, WorkCheck* work) const {
  if (matcher.empty) {
    if (!text.empty()) out->push_back({text, -1});
    return absl::OkStatus();
  }
  size_t last = 0;  // end of the previous match (and of what was absorbed around it)
  size_t i = 0;
  while (i < text.size()) {
    const AddedToken* found = nullptr;
    const std::vector<int>& bucket = matcher.by_first_byte[static_cast<unsigned char>(text[i])];
    // A bucket may hold many tokens (a hostile file: hundreds of thousands sharing one byte).
    if (absl::Status s = work->Add(1 + bucket.size()); !s.ok()) return s;
    for (int index : bucket) {
      const AddedToken& candidate = added_[index];
      if (text.substr(i, candidate.match_content.size()) == candidate.match_content) {
        found = &candidate;  // the bucket is longest first
        break;
      }
    }
    if (found == nullptr) {
      ++i;
      continue;
    }
    size_t start = i;
    size_t end = i + found->match_content.size();
    if (found->lstrip) {
      // Whitespace before it, but not what the previous match already took.
      start = std::max(last, start - TrailingWhitespace(text.substr(0, start)));
    }
    if (found->rstrip) end += LeadingWhitespace(text.substr(end));
    if (start > last) out->push_back({text.substr(last, start - last), -1});
    out->push_back({text.substr(start, end - start), found->id});
    last = end;
    i = end;
  }
  if (last < text.size()) out->push_back({text.substr(last), -1});
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> HfTokenizer::EncodeChecked(absl::string_view text,
                                                                const EncodeCheck& check) const {
  WorkCheck work(check);
  FLUXION_RETURN_IF_ERROR(work.Now());
  if (!IsValidUtf8(text)) return absl::InvalidArgumentError("text is not valid UTF-8");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  std::vector<Piece> pieces;
  FLUXION_RETURN_IF_ERROR(SplitOnAdded(text, raw_added_, &pieces, &work));
  for (const Piece& piece : pieces) {
    if (piece.added_id >= 0) {
      ids.push_back(piece.added_id);
    } else {
      FLUXION_RETURN_IF_ERROR(
          EncodeText(piece.text, /*at_start=*/piece.text.data() == text.data(), &ids, &work));
    }
  }
  return ids;
}

absl::StatusOr<absl::string_view> HfTokenizer::Normalize(absl::string_view text,
                                                         std::string* storage) const {
  absl::string_view out = text;
  for (const NormalizerStep& step : normalizers_) {
    switch (step.kind) {
      case NormalizerStep::kNfc: {
        if (IsAscii(out)) continue;  // ASCII is always NFC
        FLUXION_ASSIGN_OR_RETURN(std::string nfc, Nfc(out));
        *storage = std::move(nfc);
        break;
      }
      case NormalizerStep::kPrepend:
        if (out.empty()) continue;
        *storage = absl::StrCat(step.to, out);
        break;
      case NormalizerStep::kReplace:
        if (!absl::StrContains(out, step.from)) continue;
        *storage = absl::StrReplaceAll(out, {{step.from, step.to}});
        break;
    }
    out = *storage;
  }
  return out;
}

absl::Status HfTokenizer::EncodeText(absl::string_view text, bool at_start,
                                     std::vector<int32_t>* ids, WorkCheck* work) const {
  std::string normalized_storage;
  FLUXION_ASSIGN_OR_RETURN(absl::string_view normalized, Normalize(text, &normalized_storage));
  std::vector<Piece> pieces;
  FLUXION_RETURN_IF_ERROR(SplitOnAdded(normalized, normalized_added_, &pieces, work));
  std::vector<absl::string_view> pre_tokens;
  std::deque<std::string> storage;  // pieces with ByteLevel's prefix space or Metaspace's marks
  for (const Piece& piece : pieces) {
    if (piece.added_id >= 0) {
      ids->push_back(piece.added_id);
      continue;
    }
    pre_tokens.clear();
    FLUXION_RETURN_IF_ERROR(PreTokenize(piece.text,
                                        at_start && piece.text.data() == normalized.data(),
                                        &pre_tokens, &storage, work));
    for (absl::string_view pre_token : pre_tokens) {
      FLUXION_RETURN_IF_ERROR(work->Add(pre_token.size()));
      EncodePreToken(pre_token, ids);
    }
  }
  return absl::OkStatus();
}

absl::Status HfTokenizer::PreTokenize(absl::string_view text, bool at_start,
                                      std::vector<absl::string_view>* out,
                                      std::deque<std::string>* storage, WorkCheck* work) const {
  if (metaspace_.has_value()) {
    const std::string& mark = metaspace_->replacement;
    std::string marked = absl::StrReplaceAll(text, {{" ", mark}});
    const bool prepend = metaspace_->prepend == Metaspace::kAlways ||
                         (metaspace_->prepend == Metaspace::kFirst && at_start);
    if (prepend && !absl::StartsWith(marked, mark)) marked.insert(0, mark);
    storage->push_back(std::move(marked));
    absl::string_view rest = storage->back();
    if (!metaspace_->split) {
      if (!rest.empty()) out->push_back(rest);
      return absl::OkStatus();
    }
    // Cut before every mark, each mark starting the piece after it (HF's MergedWithNext).
    size_t start = 0;
    for (size_t at = rest.find(mark, 1); at != absl::string_view::npos;
         at = rest.find(mark, at + mark.size())) {
      out->push_back(rest.substr(start, at - start));
      start = at;
    }
    if (start < rest.size()) out->push_back(rest.substr(start));
    return work->Add(rest.size());
  }
  out->push_back(text);
  std::vector<absl::string_view> next;
  for (size_t step = 0; step <= splits_.size(); ++step) {
    // ByteLevel's add_prefix_space: every piece reaching it gets a leading space if it has none
    // (after each earlier Split, so possibly several per text, as HF does).
    if (step == byte_level_step_ && add_prefix_space_) {
      for (absl::string_view& piece : *out) {
        if (piece.empty() || piece[0] == ' ') continue;
        storage->push_back(absl::StrCat(" ", piece));
        piece = storage->back();
      }
    }
    if (step == splits_.size()) break;
    const auto& split = splits_[step];
    next.clear();
    for (absl::string_view piece : *out) FLUXION_RETURN_IF_ERROR(split->Split(piece, &next, work));
    out->swap(next);
  }
  return absl::OkStatus();
}

void HfTokenizer::EncodePreToken(absl::string_view bytes, std::vector<int32_t>* ids) const {
  if (ignore_merges_) {  // Llama-3: a pre-token that is itself a token is emitted whole
    const auto& whole = byte_level_ ? bytes_to_id_ : spelling_to_id_;
    auto it = whole.find(bytes);
    if (it != whole.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  const bool cacheable = cache_capacity_ > 0 && bytes.size() <= kMaxCachedPreTokenBytes;
  if (cacheable) {
    absl::ReaderMutexLock lock(&cache_mu_);
    auto it = cache_.find(bytes);
    if (it != cache_.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids->size();
  MergeBytes(bytes, ids);
  if (cacheable) {
    absl::MutexLock lock(&cache_mu_);
    // Full: new pre-tokens are not cached (HF's cache does the same); the common ones came first.
    if (cache_.size() < cache_capacity_) {
      cache_.emplace(std::string(bytes), std::vector<int32_t>(ids->begin() + first, ids->end()));
    }
  }
}

void HfTokenizer::InitialSymbols(absl::string_view bytes, std::vector<int32_t>* ids) const {
  // A symbol with no token: unk when the model has one (fused with a preceding unk when
  // fuse_unk), else dropped, as HF does.
  auto unknown = [&] {
    if (!unk_id_.has_value()) return;
    if (fuse_unk_ && !ids->empty() && ids->back() == *unk_id_) return;
    ids->push_back(*unk_id_);
  };
  if (byte_level_) {
    for (char c : bytes) {
      const int32_t id = byte_id_[static_cast<unsigned char>(c)];
      if (id >= 0) {
        ids->push_back(id);
      } else {
        unknown();
      }
    }
    return;
  }
  for (size_t pos = 0; pos < bytes.size();) {
    size_t length = 0;
    const uint32_t cp = CodePointAt(bytes, pos, &length);
    const absl::string_view character = bytes.substr(pos, length);
    pos += length;
    if (auto it = char_id_.find(cp); it != char_id_.end()) {
      ids->push_back(it->second);
      continue;
    }
    const bool all_bytes =
        byte_fallback_ && std::all_of(character.begin(), character.end(), [this](char c) {
          return byte_fallback_id_[static_cast<unsigned char>(c)] >= 0;
        });
    if (!all_bytes) {
      unknown();
      continue;
    }
    for (char c : character) ids->push_back(byte_fallback_id_[static_cast<unsigned char>(c)]);
  }
}

void HfTokenizer::MergeBytes(absl::string_view bytes, std::vector<int32_t>* ids) const {
  struct Symbol {
    int32_t id;
    int prev;
    int next;
    bool alive;
  };
  std::vector<int32_t> initial;
  initial.reserve(bytes.size());
  InitialSymbols(bytes, &initial);
  if (initial.empty()) return;
  std::vector<Symbol> symbols;
  symbols.reserve(initial.size());
  for (int32_t id : initial) {
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({id, index - 1, -1, true});
    if (index > 0) symbols[index - 1].next = index;
  }

  struct Candidate {
    int32_t rank;
    int pos;
    int32_t merged;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : pos > other.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push_pair = [&](int pos) {
    if (pos < 0 || symbols[pos].next < 0) return;
    const uint64_t key = (static_cast<uint64_t>(symbols[pos].id) << 32) |
                         static_cast<uint32_t>(symbols[symbols[pos].next].id);
    auto it = merges_.find(key);
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.merged});
  };
  for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) push_pair(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    // Stale when either side changed since the pair was queued (HF checks the merged id).
    const uint64_t key =
        (static_cast<uint64_t>(left.id) << 32) | static_cast<uint32_t>(symbols[left.next].id);
    auto it = merges_.find(key);
    if (it == merges_.end() || it->second.merged != top.merged) continue;
    Symbol& right = symbols[left.next];
    left.id = top.merged;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    push_pair(left.prev);
    push_pair(top.pos);
  }
  for (int i = 0; i >= 0; i = symbols[i].next) ids->push_back(symbols[i].id);
}

void HfTokenizer::AppendTokenBytes(int32_t id, bool skip_special, std::string* out) const {
  if (id < 0 || static_cast<size_t>(id) >= tokens_.size()) return;
  const Token& token = tokens_[id];
  if (!token.present || (skip_special && token.special)) return;
  out->append(token.bytes);
}

std::optional<int32_t> HfTokenizer::TokenToId(absl::string_view token) const {
  auto it = spelling_to_id_.find(token);
  if (it == spelling_to_id_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> HfTokenizer::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= tokens_.size() || !tokens_[id].present) {
    return std::nullopt;
  }
  return tokens_[id].spelling;
}

bool HfTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < tokens_.size() && tokens_[id].special;
}

size_t HfTokenizer::cache_size() const {
  absl::ReaderMutexLock lock(&cache_mu_);
  return cache_.size();
}

}  // namespace fluxion::model
