#include "model/hf_tokenizer.h"

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

std::string DataDir(const std::string& name) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(src ? src : ".") + "/tests/data/tokenizers/" + name;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every reference of tests/data/tokenizers/<name>/ (HF tokenizers 0.23.2): ids, decode and
// decode(skip_special_tokens=True) exactly.
class HfReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HfReferenceTest, MatchesHfTokenizersExactly) {
  auto tokenizer = HfTokenizer::FromFile(DataDir(GetParam()) + "/tokenizer.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto uncached = HfTokenizer::FromFile(DataDir(GetParam()) + "/tokenizer.json");
  ASSERT_TRUE(uncached.ok()) << uncached.status();
  (*uncached)->set_cache_capacity(0);
  const Json refs = Json::parse(ReadText(DataDir(GetParam()) + "/references.json"));
  ASSERT_GE(refs["cases"].size(), 20u);
  for (const Json& c : refs["cases"]) {
    const std::string text = c["text"].get<std::string>();
    SCOPED_TRACE(text);
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    auto ids = (*tokenizer)->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, want);
    EXPECT_EQ((*tokenizer)->Decode(want, /*skip_special=*/false), c["decoded"].get<std::string>());
    EXPECT_EQ((*tokenizer)->Decode(want, /*skip_special=*/true),
              c["decoded_skip_special"].get<std::string>());
    // A second encode is answered from the pre-token cache and must not differ.
    auto again = (*tokenizer)->Encode(text);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*again, want);
    EXPECT_EQ(*(*uncached)->Encode(text), want);
  }
  EXPECT_GT((*tokenizer)->cache_size(), 0u);
  EXPECT_EQ((*uncached)->cache_size(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Folders, HfReferenceTest, ::testing::Values("llama3", "qwen2"));

// Encode is const and shared by request threads: concurrent calls (filling the cache together)
// give the same ids as one thread.
TEST(HfTokenizerTest, ConcurrentEncodesAgree) {
  auto t = HfTokenizer::FromFile(DataDir("qwen2") + "/tokenizer.json");
  ASSERT_TRUE(t.ok()) << t.status();
  const Json refs = Json::parse(ReadText(DataDir("qwen2") + "/references.json"));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&] {
      for (int round = 0; round < 20; ++round) {
        for (const Json& c : refs["cases"]) {
          auto ids = (*t)->Encode(c["text"].get<std::string>());
          if (!ids.ok() || *ids != c["ids"].get<std::vector<int32_t>>()) ++mismatches;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(HfTokenizerTest, LookupsAndSpecials) {
  auto t = HfTokenizer::FromFile(DataDir("llama3") + "/tokenizer.json");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->TokenToId("<|eot_id|>"), 4);
  EXPECT_EQ((*t)->IdToToken(0), "<|begin_of_text|>");
  EXPECT_TRUE((*t)->IsSpecial(4));
  EXPECT_FALSE((*t)->IsSpecial(44));
  EXPECT_EQ((*t)->TokenToId("no such token"), std::nullopt);
  EXPECT_EQ((*t)->IdToToken(-1), std::nullopt);
  EXPECT_EQ((*t)->IdToToken((*t)->vocab_size()), std::nullopt);
  // Out-of-vocabulary ids decode to nothing, as HF skips them.
  EXPECT_EQ((*t)->Decode({44, -5, 1 << 30}, false), "H");
  EXPECT_FALSE((*t)->Encode("\xff").ok());
}

// A minimal byte-level tokenizer.json: the 256 byte tokens, `extra` vocab entries and merges.
Json MiniTokenizer() {
  Json vocab = Json::object();
  // GPT-2's byte map, spelled out: printable bytes stand for themselves, others for U+0100...
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    vocab[s] = b;
  }
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  vocab["bc"] = 258;
  Json j;
  j["model"] = {{"type", "BPE"},
                {"vocab", vocab},
                {"merges", Json::array({"a b", Json::array({"ab", "c"})})}};
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  j["decoder"] = {{"type", "ByteLevel"}};
  j["added_tokens"] =
      Json::array({{{"id", 300}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
                   {{"id", 301}, {"content", "<s>x"}, {"special", false}, {"normalized", false}}});
  return j;
}

TEST(HfTokenizerTest, MergeFormsIgnoreMergesAndLongestAddedToken) {
  Json j = MiniTokenizer();
  auto t = HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(t.ok()) << t.status();
  // Both merge forms: "a b" then ["ab", "c"]; "bc" has no merge, so "abc" comes via "ab".
  EXPECT_THAT(*(*t)->Encode("abc"), ElementsAre(257));
  EXPECT_THAT(*(*t)->Encode("bc"), ElementsAre('b', 'c'));
  // The longest added token at the leftmost position wins.
  EXPECT_THAT(*(*t)->Encode("<s>x<s>"), ElementsAre(301, 300));
  EXPECT_EQ((*t)->Decode({301, 300}, /*skip_special=*/true), "<s>x");
  // ignore_merges: a pre-token that is in the vocab is emitted whole, merges or not.
  j["model"]["ignore_merges"] = true;
  auto ignoring = HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(ignoring.ok()) << ignoring.status();
  EXPECT_THAT(*(*ignoring)->Encode("bc"), ElementsAre(258));
  EXPECT_THAT(*(*t)->Encode("bc"), ElementsAre('b', 'c'));
}

// ignore_merges looks a pre-token up by its byte-level spelling: a vocab entry that is not
// byte-level ("x y" with a raw space) is never what a pre-token " " spells ("xĠy").
TEST(HfTokenizerTest, IgnoreMergesMatchesOnlyByteLevelSpellings) {
  Json j = MiniTokenizer();
  j["model"]["ignore_merges"] = true;
  j["model"]["vocab"]["x y"] = 259;
  j["pre_tokenizer"]["use_regex"] = false;  // the whole text is one pre-token
  auto t = HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(*(*t)->Encode("x y"), ElementsAre('x', ' ', 'y'));
  EXPECT_THAT(*(*t)->Encode("abc"), ElementsAre(257));
}

// ByteLevel's add_prefix_space: each piece left after the added tokens (and earlier Splits) that
// does not start with a space gets one, as HF's ByteLevel pre-tokenizer does; Decode keeps it.
TEST(HfTokenizerTest, ByteLevelAddPrefixSpace) {
  Json j = MiniTokenizer();
  j["pre_tokenizer"]["add_prefix_space"] = true;
  auto t = HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(*(*t)->Encode("ab"), ElementsAre(' ', 256));
  EXPECT_THAT(*(*t)->Encode(" ab"), ElementsAre(' ', 256));
  EXPECT_THAT(*(*t)->Encode("ab<s>ab"), ElementsAre(' ', 256, 300, ' ', 256));
  EXPECT_EQ((*t)->Decode(*(*t)->Encode("ab"), false), " ab");
}

TEST(HfTokenizerTest, AddedTokenStripsWhitespaceWhenAsked) {
  Json j = MiniTokenizer();
  j["added_tokens"][0]["lstrip"] = true;
  j["added_tokens"][0]["rstrip"] = true;
  auto t = HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(*(*t)->Encode("a  <s>  b"), ElementsAre('a', 300, 'b'));
}

// HF's two passes: normalized=false tokens are cut out first, normalized=true ones are looked for
// in what is left, after normalizing it and matching their normalized form.
TEST(HfTokenizerTest, AddedTokensMatchInTwoPassesNormalizedLast) {
  Json j = MiniTokenizer();
  j["added_tokens"] = Json::array(
      {{{"id", 300}, {"content", "xy"}, {"special", false}, {"normalized", true}},
       {{"id", 301}, {"content", "yz"}, {"special", false}, {"normalized", false}},
       // "e" + combining acute: NFC makes it U+00E9, which is what the text will hold.
       {{"id", 302}, {"content", "<e\u0301>"}, {"special", false}, {"normalized", true}},
       {{"id", 303},
        {"content", "<s>"},
        {"special", true},
        {"normalized", false},
        {"lstrip", true}}});
  j["normalizer"] = {{"type", "NFC"}};
  auto t = HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(t.ok()) << t.status();
  // One leftmost-longest pass would take "xy"; HF takes "yz" first.
  EXPECT_THAT(*(*t)->Encode("xyz"), ElementsAre('x', 301));
  EXPECT_THAT(*(*t)->Encode("xyx"), ElementsAre(300, 'x'));
  EXPECT_THAT(*(*t)->Encode("x<e\u0301>"), ElementsAre('x', 302));  // decomposed in the text
  EXPECT_THAT(*(*t)->Encode("x<\u00e9>"), ElementsAre('x', 302));   // composed in the text
  // It decodes as its normalized form through the ByteLevel decoder, as HF's does: U+00E9 is
  // also the byte map's character for byte 0xE9, so "<\u00e9>" becomes 3C E9 3E, and the lone
  // 0xE9 is U+FFFD. (HF's quirk for Latin-1 added tokens; ASCII ones, all real specials, are
  // unaffected.)
  EXPECT_EQ((*t)->Decode({302}, false), "<\xEF\xBF\xBD>");
  // lstrip takes Unicode whitespace (U+3000 ideographic space), as HF's \s does.
  EXPECT_THAT(*(*t)->Encode("x\u3000 <s>"), ElementsAre('x', 303));
}

// A Split whose pattern is a literal String; both Split and ByteLevel's own regex apply in turn.
TEST(HfTokenizerTest, SplitOnLiteralStringThenByteLevelRegex) {
  Json j = MiniTokenizer();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       Json::array({{{"type", "Split"},
                     {"pattern", {{"String", "c"}}},
                     {"behavior", "Isolated"},
                     {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}})}};
  auto t = HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(t.ok()) << t.status();
  // "c" is cut out before merging, so "ab"+"c" never meets; " ab" is one GPT-2 pre-token.
  EXPECT_THAT(*(*t)->Encode("abc"), ElementsAre(256, 'c'));
  EXPECT_THAT(*(*t)->Encode("x ab"), ElementsAre('x', ' ', 256));
}

// A pattern that backtracks exponentially on runs of "a" without a "b" hits PCRE2's match limit:
// the same text fails the same way every time, so it is InvalidArgument saying why (an HTTP
// client gets 400), not ResourceExhausted ("try later").
TEST(HfTokenizerTest, RegexMatchLimitIsAPermanentInvalidArgument) {
  Json j = MiniTokenizer();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       Json::array({{{"type", "Split"},
                     {"pattern", {{"Regex", "(?:a+)+b|a"}}},
                     {"behavior", "Isolated"},
                     {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  auto t = HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE((*t)->Encode("aab").ok());
  auto ids = (*t)->Encode(std::string(64, 'a'));
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << ids.status();
  EXPECT_THAT(ids.status().message(), HasSubstr("gave up after 1000000 steps"));
}

// EncodeChecked's check runs before the work and again within a bounded amount of it, here while
// the added tokens are looked for (a hostile file: thousands sharing a first byte, each position
// compared against all of them); its first error ends the encoding.
TEST(HfTokenizerTest, EncodeCheckBoundsTheWork) {
  Json j = MiniTokenizer();
  for (int i = 0; i < 4000; ++i) {
    j["added_tokens"].push_back({{"id", 400 + i},
                                 {"content", absl::StrCat("a", i, "~")},
                                 {"special", false},
                                 {"normalized", false}});
  }
  auto t = HfTokenizer::FromJson(j.dump());
  ASSERT_TRUE(t.ok()) << t.status();
  const std::string text(4000, 'a');
  int calls = 0;
  auto ok = [&calls] {
    ++calls;
    return absl::OkStatus();
  };
  auto all = (*t)->EncodeChecked(text, ok);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(*all, *(*t)->Encode(text));
  EXPECT_GT(calls, 10);  // 4000 positions x 4000 candidates: checked many times
  calls = 0;
  auto stop_second = [&calls]() -> absl::Status {
    return ++calls < 2 ? absl::OkStatus() : absl::DeadlineExceededError("enough");
  };
  auto stopped = (*t)->EncodeChecked(text, stop_second);
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kDeadlineExceeded) << stopped.status();
  EXPECT_EQ(calls, 2);
  auto before = (*t)->EncodeChecked("ab", [] { return absl::CancelledError("gone"); });
  EXPECT_EQ(before.status().code(), absl::StatusCode::kCancelled);
}

// A SentencePiece-style tokenizer in Mistral v0.3's layout: Metaspace pre-tokenizer, byte
// fallback, unk, and the decoder Replace (mark -> space), ByteFallback, Fuse, Strip one leading
// space. "\xE2\x96\x81" is U+2581, the mark spaces become.
Json MiniSentencePiece(const std::string& prepend_scheme, bool split) {
  Json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    static constexpr char kHex[] = "0123456789ABCDEF";
    vocab[absl::StrCat("<0x", std::string(1, kHex[b >> 4]), std::string(1, kHex[b & 15]), ">")] =
        3 + b;
  }
  const std::string mark = "\xE2\x96\x81";
  vocab[mark] = 259;
  vocab["h"] = 260;
  vocab["i"] = 261;
  vocab[mark + "h"] = 262;
  vocab[mark + "hi"] = 263;
  vocab["a"] = 264;
  const Json metaspace = {
      {"type", "Metaspace"}, {"replacement", mark}, {"prepend_scheme", prepend_scheme},
      {"split", split}};
  Json j;
  j["model"] = {{"type", "BPE"},           {"vocab", vocab},      {"unk_token", "<unk>"},
                {"byte_fallback", true},   {"fuse_unk", true},
                {"merges", Json::array({Json::array({mark, "h"}), Json::array({mark + "h", "i"})})}};
  j["pre_tokenizer"] = metaspace;
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders", Json::array({{{"type", "Replace"},
                                             {"pattern", {{"String", mark}}},
                                             {"content", " "}},
                                            {{"type", "ByteFallback"}},
                                            {{"type", "Fuse"}},
                                            {{"type", "Strip"},
                                             {"content", " "},
                                             {"start", 1},
                                             {"stop", 0}}})}};
  j["added_tokens"] =
      Json::array({{{"id", 1}, {"content", "<s>"}, {"special", true}, {"normalized", false}}});
  return j;
}

TEST(HfTokenizerTest, MetaspaceMarksSpacesPrependsPerSchemeAndFallsBackToBytes) {
  auto first = HfTokenizer::FromJson(MiniSentencePiece("first", false).dump());
  ASSERT_TRUE(first.ok()) << first.status();
  const HfTokenizer& t = **first;
  EXPECT_THAT(*t.Encode("hi"), ElementsAre(263));
  EXPECT_THAT(*t.Encode("hi hi"), ElementsAre(263, 263));
  // After an added token the text no longer starts the input: "first" prepends nothing.
  EXPECT_THAT(*t.Encode("<s>hi"), ElementsAre(1, 260, 261));
  // Characters outside the vocabulary become their UTF-8 bytes' tokens.
  EXPECT_THAT(*t.Encode("\n"), ElementsAre(259, 3 + 0x0A));
  EXPECT_THAT(*t.Encode("\xC3\xA9"), ElementsAre(259, 3 + 0xC3, 3 + 0xA9));
  // The decoder turns marks back into spaces, bytes back into text, and drops the first space.
  EXPECT_EQ(t.Decode({263, 263}, false), "hi hi");
  EXPECT_EQ(t.Decode({259, 3 + 0xC3, 3 + 0xA9}, false), "\xC3\xA9");
  EXPECT_EQ(t.Decode({1, 263}, false), "<s> hi");
  EXPECT_EQ(t.Decode({1, 263}, true), "hi");
  std::string one;
  t.AppendTokenBytes(263, false, &one);
  EXPECT_EQ(one, " hi");  // a streamed token keeps its space: it continues the text before it

  // The Metaspace decoder: marks become spaces and the first is dropped, but without a
  // ByteFallback step byte tokens stay spelled out, as in HF.
  Json always_json = MiniSentencePiece("always", true);
  always_json["decoder"] = always_json["pre_tokenizer"];
  auto always = HfTokenizer::FromJson(always_json.dump());
  ASSERT_TRUE(always.ok()) << always.status();
  EXPECT_THAT(*(*always)->Encode("<s>hi"), ElementsAre(1, 263));
  EXPECT_EQ((*always)->Decode({263, 263}, false), "hi hi");
  EXPECT_EQ((*always)->Decode({259, 3 + 0xC3}, false), "<0xC3>");
  // split: cut before every mark, so "ahi hi" merges within "\xE2\x96\x81ahi" and "\xE2\x96\x81hi".
  EXPECT_THAT(*(*always)->Encode("ahi hi"), ElementsAre(259, 264, 260, 261, 263));

  Json never_json = MiniSentencePiece("never", false);
  never_json["model"]["byte_fallback"] = false;
  auto never = HfTokenizer::FromJson(never_json.dump());
  ASSERT_TRUE(never.ok()) << never.status();
  EXPECT_THAT(*(*never)->Encode("hi"), ElementsAre(260, 261));
  EXPECT_THAT(*(*never)->Encode(" hi"), ElementsAre(263));
  // Without byte fallback an unknown character is unk, consecutive ones fused.
  EXPECT_THAT(*(*never)->Encode("\xC3\xA9\xC3\xA9h"), ElementsAre(0, 260));
  never_json["decoder"] = never_json["pre_tokenizer"];
  auto never_decoder = HfTokenizer::FromJson(never_json.dump());
  ASSERT_TRUE(never_decoder.ok()) << never_decoder.status();
  EXPECT_EQ((*never_decoder)->Decode({263}, false), " hi");  // "never" strips nothing
}

void ExpectInvalid(const std::string& json, const std::string& message_part) {
  auto t = HfTokenizer::FromJson(json);
  ASSERT_FALSE(t.ok()) << "accepted: " << json.substr(0, 200);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr(message_part));
}

TEST(HfTokenizerTest, MalformedFilesAreInvalidArgumentNamingTheField) {
  const std::string good = MiniTokenizer().dump();
  ExpectInvalid(good.substr(0, good.size() / 2), "not valid JSON");
  ExpectInvalid("[1, 2]", "must hold an object");
  ExpectInvalid(std::string(100, '[') + std::string(100, ']'), "nested deeper");
  auto with = [](auto edit) {
    Json j = MiniTokenizer();
    edit(j);
    return j.dump();
  };
  ExpectInvalid(with([](Json& j) { j.erase("model"); }), "'model' is required");
  ExpectInvalid(with([](Json& j) { j["model"]["type"] = "WordPiece"; }), "model.type");
  ExpectInvalid(with([](Json& j) { j["model"]["type"] = 7; }), "model.type");
  ExpectInvalid(with([](Json& j) { j["model"]["vocab"] = Json::array(); }), "model.vocab");
  ExpectInvalid(with([](Json& j) { j["model"]["vocab"]["x"] = "one"; }), "integer id");
  ExpectInvalid(with([](Json& j) { j["model"]["vocab"]["x"] = -1; }), "outside");
  ExpectInvalid(with([](Json& j) { j["model"]["vocab"]["x"] = int64_t{1} << 40; }), "outside");
  ExpectInvalid(with([](Json& j) { j["model"]["vocab"]["xy"] = 0; }), "reuses id 0");
  ExpectInvalid(with([](Json& j) { j["model"]["vocab"][std::string(5000, 'q')] = 999; }),
                "above the limit");
  ExpectInvalid(with([](Json& j) { j["model"]["merges"] = "a b"; }), "model.merges");
  ExpectInvalid(with([](Json& j) { j["model"]["merges"].push_back("abc"); }), "model.merges[2]");
  ExpectInvalid(with([](Json& j) {
                  j["model"]["merges"].push_back(Json::array({"a", 3}));
                }),
                "model.merges[2]");
  ExpectInvalid(with([](Json& j) { j["model"]["merges"].push_back("c a"); }),
                "missing from model.vocab");
  ExpectInvalid(with([](Json& j) { j["model"]["byte_fallback"] = true; }), "byte_fallback");
  ExpectInvalid(with([](Json& j) { j["model"]["dropout"] = 0.1; }), "model.dropout");
  ExpectInvalid(with([](Json& j) { j["model"]["unk_token"] = "<unk>"; }), "model.unk_token");
  ExpectInvalid(with([](Json& j) { j["added_tokens"] = Json::object(); }), "added_tokens");
  ExpectInvalid(with([](Json& j) { j["added_tokens"][0]["content"] = "ab"; }),
                "disagrees with model.vocab");
  ExpectInvalid(with([](Json& j) { j["added_tokens"][1]["content"] = "<s>"; }),
                "repeats an earlier added token");
  ExpectInvalid(with([](Json& j) { j["added_tokens"][0].erase("id"); }), "added_tokens[0].id");
  ExpectInvalid(with([](Json& j) { j["added_tokens"][1]["content"] = ""; }),
                "added_tokens[1].content");
  ExpectInvalid(with([](Json& j) { j["added_tokens"][0]["special"] = "yes"; }),
                "added_tokens[0].special");
  ExpectInvalid(with([](Json& j) {
                  j["normalizer"] = {{"type", "Lowercase"}};
                }),
                "normalizer.type");
  ExpectInvalid(with([](Json& j) {
                  j["pre_tokenizer"] = {{"type", "Whitespace"}};
                }),
                "pre_tokenizer.type");
  ExpectInvalid(with([](Json& j) { j["pre_tokenizer"] = 7; }), "pre_tokenizer");
  ExpectInvalid(with([](Json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }),
                "decoder.type");
  ExpectInvalid(with([](Json& j) { j["decoder"] = {{"type", "Metaspace"}}; }), "decoder.type");
  ExpectInvalid(with([](Json& j) {
                  j["normalizer"] = {{"type", "Replace"},
                                     {"pattern", {{"Regex", " +"}}},
                                     {"content", "_"}};
                }),
                "normalizer.pattern");
  ExpectInvalid(with([](Json& j) {
                  j.erase("pre_tokenizer");
                  j["decoder"] = {
                      {"type", "Sequence"},
                      {"decoders", Json::array({{{"type", "Strip"},
                                                 {"content", " "},
                                                 {"start", 1},
                                                 {"stop", 0}},
                                                {{"type", "Fuse"}}})}};
                }),
                "decoder.decoders[0]");
  ExpectInvalid(
      with([](Json& j) {
        j["pre_tokenizer"] = {
            {"type", "Sequence"},
            {"pretokenizers", Json::array({{{"type", "Split"},
                                            {"pattern", {{"Regex", "(unclosed"}}},
                                            {"behavior", "Isolated"}},
                                           {{"type", "ByteLevel"}, {"add_prefix_space", false}}})}};
      }),
      "pre_tokenizer.pretokenizers[0].pattern.Regex");
  ExpectInvalid(
      with([](Json& j) {
        j["pre_tokenizer"] = {
            {"type", "Sequence"},
            {"pretokenizers",
             Json::array(
                 {{{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Removed"}},
                  {{"type", "ByteLevel"}, {"add_prefix_space", false}}})}};
      }),
      "behavior");
  ExpectInvalid(with([](Json& j) { j["decoder"] = {{"type", "WordPiece"}}; }), "decoder.type");
}

TEST(HfTokenizerTest, FileErrors) {
  EXPECT_EQ(HfTokenizer::FromFile("/nonexistent/tokenizer.json").status().code(),
            absl::StatusCode::kNotFound);
  ScopedTestTempDir dir;
  std::ofstream(dir.File("tokenizer.json")) << "{\"model\": ";
  auto t = HfTokenizer::FromFile(dir.File("tokenizer.json"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer.json"));
}

TEST(LoadTokenizerTest, PicksTokenizerJsonThenOurByteModelElseExplains) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  const std::string root = src ? src : ".";
  auto hf = LoadTokenizer(root + "/tests/data/tokenizers/qwen2");
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ((*hf)->TokenToId("<|im_end|>"), 2);

  auto byte = LoadTokenizer(root + "/models/fluxion-tiny-retrieval");
  ASSERT_TRUE(byte.ok()) << byte.status();
  EXPECT_EQ((*byte)->vocab_size(), 264);
  EXPECT_THAT(*(*byte)->Encode("hi"), ElementsAre('h', 'i'));
  EXPECT_EQ((*byte)->Decode({'h', 'i', 257}, /*skip_special=*/false), "hi<eos>");
  EXPECT_EQ((*byte)->Decode({'h', 'i', 257}, /*skip_special=*/true), "hi");
  EXPECT_EQ((*byte)->Decode({0xE2, 0x82}, false), "\xEF\xBF\xBD");

  ScopedTestTempDir empty;
  auto none = LoadTokenizer(empty.dir());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("neither tokenizer.json, tokenizer.model nor config.json"));

  ScopedTestTempDir other;
  std::ofstream(other.File("config.json"))
      << R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 1,
             "eos_token_id": 2})";
  auto foreign = LoadTokenizer(other.dir());
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kFailedPrecondition) << foreign.status();
  EXPECT_THAT(foreign.status().message(), HasSubstr("copy the model's tokenizer.json"));
}

// The fuzz target's seeds (tests/fuzz/corpus/hf_tokenizer_fuzz/) load, so mutation starts from
// accepted files: NFC, a Split regex with lookahead, ByteLevel's own GPT-2 regex, ignore_merges.
TEST(HfTokenizerTest, FuzzSeedsLoadAndEncode) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  const std::string corpus = std::string(src ? src : ".") + "/tests/fuzz/corpus/hf_tokenizer_fuzz/";
  for (const char* name : {"mini_bytelevel.json", "mini_gpt2_regex.json", "qwen2_small.json"}) {
    SCOPED_TRACE(name);
    auto t = HfTokenizer::FromFile(corpus + name);
    ASSERT_TRUE(t.ok()) << t.status();
    auto ids = (*t)->Encode("abc  abc<|endoftext|>x");
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ((*t)->Decode(*ids, false), "abc  abc<|endoftext|>x");
  }
  auto mini = HfTokenizer::FromFile(corpus + "mini_bytelevel.json");
  ASSERT_TRUE(mini.ok());
  // "   x": \s+(?!\S) takes two spaces (not the third, which a non-space follows), \s+ the
  // third, then "x"; the two-space pre-token is in the vocab and comes out whole.
  EXPECT_THAT(*(*mini)->Encode("   x"), ElementsAre(258, ' ', 'x'));
}

TEST(Utf8Test, LossyConversionReplacesMaximalSubparts) {
  auto lossy = [](absl::string_view bytes) {
    std::string out;
    AppendUtf8Lossy(bytes, /*final=*/true, &out);
    return out;
  };
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(lossy("a\x80z"), "a" + r + "z");
  EXPECT_EQ(lossy("\xE2\x82z"), r + "z");               // truncated 3-byte sequence: one U+FFFD
  EXPECT_EQ(lossy("\xF0\x9F\x99"), r);                  // incomplete at the end
  EXPECT_EQ(lossy("\xED\xA0\x80"), r + r + r);          // a surrogate: three maximal subparts
  EXPECT_EQ(lossy("\xC0\xAF"), r + r);                  // overlong
  EXPECT_EQ(lossy("\xF4\x90\x80\x80"), r + r + r + r);  // above U+10FFFF
  std::string held;
  EXPECT_EQ(AppendUtf8Lossy("ok\xF0\x9F\x99", /*final=*/false, &held), 2u);
  EXPECT_EQ(held, "ok");
  EXPECT_TRUE(IsValidUtf8("h\xC3\xA9llo \xF0\x9F\x99\x82"));
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));
}

}  // namespace
}  // namespace fluxion::model
