// Hugging Face tokenizer.json BPE: byte-level (Llama-3, Qwen2/2.5, GPT-2 style) and
// SentencePiece-style with byte fallback (Llama-2, Mistral, Gemma); what is supported and what is
// not is docs/TOKENIZER.md. Encode and Decode match HF `tokenizers` (tested against references
// made with 0.23.2, tests/data/tokenizers/).
//
// Encode: added tokens are cut out of the text first (leftmost, longest first, as HF's
// split_special_tokens=false); the rest is normalized (NFC, Prepend, Replace), split by the
// pre-tokenizer (regexes, PCRE2: HF's patterns need lookahead; or Metaspace) into pre-tokens, and
// each pre-token's symbols (bytes for byte-level BPE, characters with byte fallback otherwise)
// are merged by rank (a heap over adjacent pairs, HF's algorithm) with a bounded cache of results.
//
// Thread-safe: const members may be called concurrently (the cache has its own lock).
#ifndef FLUXION_MODEL_HF_TOKENIZER_H_
#define FLUXION_MODEL_HF_TOKENIZER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "model/tokenizer.h"

namespace fluxion::model {

// Bounds on what a tokenizer.json may hold (the real ones: Llama-3 128,256 tokens, 280,147 merges,
// 9 MB; Qwen2.5 151,665 tokens, 151,387 merges, 7 MB).
inline constexpr size_t kMaxTokenizerJsonBytes = size_t{128} << 20;
inline constexpr int64_t kMaxTokenizerVocab = int64_t{1} << 21;  // ids, vocab and added tokens
inline constexpr int64_t kMaxTokenizerMerges = int64_t{1} << 22;
inline constexpr size_t kMaxTokenBytes = 1024;  // one token's spelling
inline constexpr size_t kMaxPreTokenizerPatternBytes = 4096;
inline constexpr int kMaxTokenizerJsonDepth = 64;

class HfTokenizer final : public Tokenizer {
 public:
  // Parses tokenizer.json text / reads and parses a file. InvalidArgument naming the field for a
  // malformed, oversized or unsupported file; NotFound when `path` does not exist.
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> FromJson(absl::string_view json);
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> FromFile(const std::string& path);

  ~HfTokenizer() override;
  HfTokenizer(const HfTokenizer&) = delete;
  HfTokenizer& operator=(const HfTokenizer&) = delete;

  absl::StatusOr<std::vector<int32_t>> EncodeChecked(absl::string_view text,
                                                     const EncodeCheck& check) const override;
  void AppendTokenBytes(int32_t id, bool skip_special, std::string* out) const override;
  std::optional<int32_t> TokenToId(absl::string_view token) const override;
  std::optional<std::string> IdToToken(int32_t id) const override;
  bool IsSpecial(int32_t id) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(tokens_.size()); }
  int leading_spaces_stripped() const override { return decode_strip_; }

  // Entries in the pre-token cache (for tests and the bench).
  size_t cache_size() const;
  // Bounds the cache (default kDefaultCacheCapacity entries; 0: off, every pre-token is merged).
  // For the bench; call before sharing the tokenizer between threads.
  void set_cache_capacity(size_t entries) { cache_capacity_ = entries; }
  static constexpr size_t kDefaultCacheCapacity = 1 << 15;

  struct AddedToken {
    std::string content;
    std::string match_content;  // NFC of `content` when normalized and the normalizer is NFC
    int32_t id = 0;
    bool special = false;
    bool lstrip = false;
    bool rstrip = false;
    bool normalized = false;
  };
  class Regex;      // a compiled PCRE2 pattern (hf_tokenizer.cc)
  class WorkCheck;  // runs an EncodeCheck every so much work (hf_tokenizer.cc)

 private:
  struct Token {
    std::string spelling;  // as in the vocabulary / added token ("Ġthe")
    std::string bytes;     // what it decodes to (" the")
    bool present = false;
    bool added = false;  // from added_tokens (else the model vocab only)
    bool special = false;
  };
  struct Merge {
    int32_t rank;
    int32_t merged;
  };
  // The added tokens matched in one pass (HF matches those with normalized=false on the raw text
  // and those with normalized=true after normalizing), bucketed by first byte, longest first.
  struct AddedMatcher {
    std::array<std::vector<int>, 256> by_first_byte;  // indices into added_
    bool empty = true;
  };
  struct Piece {
    absl::string_view text;
    int32_t added_id;  // -1: text still to tokenize
  };
  // One normalizer of the file's list, applied in order.
  struct NormalizerStep {
    enum Kind { kNfc, kPrepend, kReplace } kind;
    std::string from, to;  // kReplace: every `from` becomes `to`; kPrepend: `to` before a non-empty text
  };
  // The Metaspace pre-tokenizer: spaces become `replacement`, which is prepended to every piece
  // (kAlways) or to the piece at the start of the text (kFirst) that does not start with it, and
  // with `split` each piece is cut before every replacement.
  struct Metaspace {
    enum Prepend { kAlways, kFirst, kNever };
    std::string replacement;
    Prepend prepend = kAlways;
    bool split = true;
  };

  HfTokenizer();
  friend class HfTokenizerLoader;

  absl::Status SplitOnAdded(absl::string_view text, const AddedMatcher& matcher,
                            std::vector<Piece>* out, WorkCheck* work) const;
  // `at_start`: `text` begins the encoded text (Metaspace's prepend_scheme "first").
  absl::Status EncodeText(absl::string_view text, bool at_start, std::vector<int32_t>* ids,
                          WorkCheck* work) const;
  // `text` after the normalizers; `storage` holds it when it differs.
  absl::StatusOr<absl::string_view> Normalize(absl::string_view text, std::string* storage) const;
  // Appends the pre-tokens of `text` to `out`; pieces that are not substrings of `text` (with
  // a prefix space, or Metaspace's replacements) live in `storage`.
  absl::Status PreTokenize(absl::string_view text, bool at_start,
                           std::vector<absl::string_view>* out, std::deque<std::string>* storage,
                           WorkCheck* work) const;
  void EncodePreToken(absl::string_view bytes, std::vector<int32_t>* ids) const;
  void MergeBytes(absl::string_view bytes, std::vector<int32_t>* ids) const;
  // The symbols a pre-token starts as, before any merge: one per byte (byte-level BPE) or one per
  // character, a character missing from the vocabulary as its <0xXX> byte tokens (byte_fallback)
  // or unk.
  void InitialSymbols(absl::string_view bytes, std::vector<int32_t>* ids) const;

  std::vector<Token> tokens_;                                 // by id
  absl::flat_hash_map<std::string, int32_t> spelling_to_id_;  // vocab, then added tokens
  absl::flat_hash_map<std::string, int32_t> bytes_to_id_;     // model vocab, by decoded bytes
  absl::flat_hash_map<uint64_t, Merge> merges_;               // (left id << 32 | right id)
  std::array<int32_t, 256> byte_id_;                          // single-byte tokens; -1 if absent
  // Character-level BPE: single-character vocab tokens by code point, and the <0xXX> tokens.
  absl::flat_hash_map<uint32_t, int32_t> char_id_;
  std::array<int32_t, 256> byte_fallback_id_;  // -1 if absent
  bool byte_level_ = true;  // the decoder is ByteLevel: symbols start as bytes
  bool byte_fallback_ = false;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  bool nfc_ = false;  // an NFC step among normalizers_ (ASCII text may skip it)
  std::vector<NormalizerStep> normalizers_;
  std::optional<Metaspace> metaspace_;
  int decode_strip_ = 0;  // leading spaces the decoder strips from a decoded text
  std::vector<AddedToken> added_;
  AddedMatcher raw_added_;
  AddedMatcher normalized_added_;
  std::vector<std::unique_ptr<Regex>> splits_;  // applied in order, each on every piece
  size_t byte_level_step_ = 0;     // splits_[byte_level_step_..] are ByteLevel's own regex
  bool add_prefix_space_ = false;  // ByteLevel's: a space before every piece lacking one

  size_t cache_capacity_ = kDefaultCacheCapacity;
  static constexpr size_t kMaxCachedPreTokenBytes = 256;
  mutable absl::Mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_ ABSL_GUARDED_BY(cache_mu_);
};

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_HF_TOKENIZER_H_
