#include "model/stream_detokenizer.h"

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/hf_tokenizer.h"
#include "model/tokenizer.h"

namespace fluxion::model {
namespace {

std::unique_ptr<HfTokenizer> LoadReference(const std::string& name) {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  auto t = HfTokenizer::FromFile(std::string(src ? src : ".") + "/tests/data/tokenizers/" + name +
                                 "/tokenizer.json");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

StreamDetokenizer MakeStream(const Tokenizer* t, std::vector<std::string> stop = {},
                             bool skip_special = false) {
  StreamDetokenizerOptions options;
  options.skip_special = skip_special;
  options.stop = std::move(stop);
  auto stream = StreamDetokenizer::Create(t, std::move(options));
  EXPECT_TRUE(stream.ok()) << stream.status();
  return std::move(*stream);
}

// Multi-byte text whose characters the small trained vocabularies split across tokens (CJK,
// emoji, ZWJ sequences, flags): after every id the streamed text is valid UTF-8, a prefix of the
// full decode of the ids so far, and equal to it whenever those ids end on a character boundary;
// after Finish it is the full decode.
TEST(StreamDetokenizerTest, EqualsFullDecodeAtEveryPrefix) {
  for (const std::string name : {"llama3", "qwen2"}) {
    auto t = LoadReference(name);
    ASSERT_NE(t, nullptr);
    for (const std::string text :
         {"日本語の文章 中文句子 한국어 문장",
          "emoji 🙂🚀 👩‍💻 family 👨‍👩‍👧‍👦 flag 🇩🇪 skin 👍🏽",
          "naïve café — «quoted» “curly”", "<|im_start|>user\nhi 🙂<|im_end|>"}) {
      SCOPED_TRACE(name + ": " + text);
      auto ids = t->Encode(text);
      ASSERT_TRUE(ids.ok()) << ids.status();
      StreamDetokenizer stream = MakeStream(t.get());
      std::string streamed;
      int held_back = 0;
      for (size_t i = 0; i < ids->size(); ++i) {
        streamed += stream.Add((*ids)[i]);
        const std::vector<int32_t> prefix(ids->begin(), ids->begin() + i + 1);
        std::string bytes;
        for (int32_t id : prefix) t->AppendTokenBytes(id, false, &bytes);
        const std::string full = t->Decode(prefix, false);
        ASSERT_TRUE(IsValidUtf8(streamed));
        if (IsValidUtf8(bytes)) {
          EXPECT_EQ(streamed, full) << "after " << i + 1 << " ids";
        } else {
          ++held_back;
          EXPECT_EQ(full.compare(0, streamed.size(), streamed), 0) << "after " << i + 1;
          EXPECT_LT(streamed.size(), full.size());
        }
      }
      streamed += stream.Finish();
      EXPECT_EQ(streamed, t->Decode(*ids, false));
      EXPECT_EQ(streamed, text);
      if (text.rfind("emoji", 0) == 0) {
        EXPECT_GT(held_back, 0) << "no character was split";
      }
    }
  }
}

// A token sequence ending in half a character: held back while it may complete, one U+FFFD at
// Finish, as the whole decode writes it; an impossible byte is U+FFFD at once.
TEST(StreamDetokenizerTest, InvalidBytesBecomeReplacementAsHfDecodes) {
  std::unique_ptr<Tokenizer> bytes = NewByteTokenizer();
  StreamDetokenizer stream = MakeStream(bytes.get());
  EXPECT_EQ(stream.Add('a'), "a");
  EXPECT_EQ(stream.Add(0xF0), "");
  EXPECT_EQ(stream.Add(0x9F), "");
  EXPECT_EQ(stream.Finish(), "\xEF\xBF\xBD");
  StreamDetokenizer bad = MakeStream(bytes.get());
  EXPECT_EQ(bad.Add(0xE2), "");
  EXPECT_EQ(bad.Add('x'), "\xEF\xBF\xBDx");
  EXPECT_EQ(bad.Add(0xFF), "\xEF\xBF\xBD");
  EXPECT_EQ(bytes->Decode({0xE2, 'x', 0xFF}, false), "\xEF\xBF\xBDx\xEF\xBF\xBD");
}

std::string Feed(StreamDetokenizer* stream, const std::vector<int32_t>& ids,
                 std::vector<std::string>* chunks = nullptr) {
  std::string out;
  for (int32_t id : ids) {
    std::string chunk = stream->Add(id);
    if (chunks != nullptr) chunks->push_back(chunk);
    out += chunk;
  }
  return out;
}

std::vector<int32_t> Bytes(absl::string_view text) {  // the byte tokenizer's ids
  std::vector<int32_t> ids;
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

TEST(StreamDetokenizerTest, StopStringSpanningTokensEndsTheText) {
  std::unique_ptr<Tokenizer> bytes = NewByteTokenizer();
  StreamDetokenizer stream = MakeStream(bytes.get(), {"STOP"});
  std::vector<std::string> chunks;
  std::string out = Feed(&stream, Bytes("abc STxSTOP after"), &chunks);
  out += stream.Finish();
  EXPECT_EQ(out, "abc STx");
  EXPECT_TRUE(stream.stopped());
  EXPECT_EQ(stream.matched_stop(), "STOP");
  // "S" and "ST" were held until "x" showed they start no stop string.
  EXPECT_EQ(chunks[4], "");
  EXPECT_EQ(chunks[5], "");
  EXPECT_EQ(chunks[6], "STx");
  EXPECT_EQ(stream.Add('z'), "");  // nothing after a stop
}

TEST(StreamDetokenizerTest, StopStringAcrossHfTokensAndCharacters) {
  auto t = LoadReference("qwen2");
  ASSERT_NE(t, nullptr);
  const std::string text = "the quick brown fox 🙂🚀 jumps over";
  auto ids = t->Encode(text);
  ASSERT_TRUE(ids.ok());
  for (const std::string stop : {"fox 🙂", "🚀 ju", "k br", "over"}) {
    SCOPED_TRACE(stop);
    StreamDetokenizer stream = MakeStream(t.get(), {"never", stop});
    std::string out = Feed(&stream, *ids);
    out += stream.Finish();
    EXPECT_EQ(out, text.substr(0, text.find(stop)));
    EXPECT_EQ(stream.matched_stop(), stop);
  }
  // A held-back prefix of a stop string that never completes is emitted at Finish.
  StreamDetokenizer stream = MakeStream(t.get(), {"overt"});
  std::string out = Feed(&stream, *ids);
  EXPECT_EQ(out, "the quick brown fox 🙂🚀 jumps ");
  EXPECT_EQ(stream.Finish(), "over");
  EXPECT_FALSE(stream.stopped());
}

// The stop string that completes first wins (whatever the token boundaries); of two completing
// at the same byte, the longer. Skipped specials take no part in matching.
TEST(StreamDetokenizerTest, FirstCompletedStopWinsAndSpecialsAreSkipped) {
  std::unique_ptr<Tokenizer> bytes = NewByteTokenizer();
  std::vector<int32_t> ids = Bytes("ab");
  ids.push_back(257);  // <eos>, skipped
  for (int32_t id : Bytes("cdef")) ids.push_back(id);
  StreamDetokenizer first = MakeStream(bytes.get(), {"bcde", "cd"}, /*skip_special=*/true);
  EXPECT_EQ(Feed(&first, ids) + first.Finish(), "ab");
  EXPECT_EQ(first.matched_stop(), "cd");
  StreamDetokenizer longer = MakeStream(bytes.get(), {"cd", "bcd"}, /*skip_special=*/true);
  EXPECT_EQ(Feed(&longer, ids) + longer.Finish(), "a");
  EXPECT_EQ(longer.matched_stop(), "bcd");
  StreamDetokenizer shown = MakeStream(bytes.get(), {"b<eos>c"}, /*skip_special=*/false);
  EXPECT_EQ(Feed(&shown, ids) + shown.Finish(), "a");
}

// Property, on 2,000 random texts over a small alphabet (with 2- and 4-byte characters) and
// random stop strings, fed one byte-token at a time: the streamed text is the whole text cut
// where the first stop string to complete starts (the longest of those ending there), or the
// whole text when none occurs; and it is valid UTF-8 after every id.
TEST(StreamDetokenizerTest, StopsMatchTheWholeTextRuleOnRandomTexts) {
  std::unique_ptr<Tokenizer> bytes = NewByteTokenizer();
  std::mt19937 rng(12345);
  const std::vector<std::string> alphabet = {"a", "b", "\xC3\xA9", "\xF0\x9F\x99\x82"};
  auto random_string = [&](int max_chars) {
    std::string out;
    const int n = 1 + static_cast<int>(rng() % max_chars);
    for (int i = 0; i < n; ++i) out += alphabet[rng() % alphabet.size()];
    return out;
  };
  for (int trial = 0; trial < 2000; ++trial) {
    const std::string text = random_string(24);
    std::vector<std::string> stops;
    const int n_stops = static_cast<int>(rng() % 4);
    for (int i = 0; i < n_stops; ++i) stops.push_back(random_string(4));
    size_t best_end = std::string::npos, best_start = std::string::npos;
    for (const std::string& stop : stops) {
      const size_t at = text.find(stop);
      if (at == std::string::npos) continue;
      const size_t end = at + stop.size();
      if (end < best_end || (end == best_end && at < best_start)) {
        best_end = end;
        best_start = at;
      }
    }
    const std::string want = best_start == std::string::npos ? text : text.substr(0, best_start);
    StreamDetokenizer stream = MakeStream(bytes.get(), stops);
    std::string got;
    for (int32_t id : Bytes(text)) {
      got += stream.Add(id);
      ASSERT_TRUE(IsValidUtf8(got));
    }
    got += stream.Finish();
    ASSERT_EQ(got, want) << "trial " << trial << " text " << text;
    EXPECT_EQ(stream.stopped(), best_start != std::string::npos);
  }
}

TEST(StreamDetokenizerTest, BadStopStringsAreInvalidArgument) {
  std::unique_ptr<Tokenizer> bytes = NewByteTokenizer();
  for (std::vector<std::string> stop :
       {std::vector<std::string>{""}, std::vector<std::string>{"\xff"},
        std::vector<std::string>{std::string(kMaxStopStringBytes + 1, 'a')},
        std::vector<std::string>(kMaxStopStrings + 1, "a")}) {
    StreamDetokenizerOptions options;
    options.stop = stop;
    EXPECT_EQ(StreamDetokenizer::Create(bytes.get(), options).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace fluxion::model
