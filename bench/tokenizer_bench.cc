// `fluxion bench tokenizer`: the text path's cost per token (docs/TOKENIZER.md), single thread:
// Encode with the pre-token cache off (every pre-token merged: the cost for text unlike any seen
// before) and warm, Decode of the whole text, and streaming detokenization (one Add per id, as the
// serving loop will call it).
#include "bench/tokenizer_bench.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "common/flag_set.h"
#include "model/hf_tokenizer.h"
#include "model/stream_detokenizer.h"
#include "model/tokenizer.h"

namespace fluxion::bench {
namespace {

// Varied text when no --text file is given: prose, code, numbers, whitespace runs, accents, CJK
// and emoji (the kinds of the HF references, tests/data/tokenizers/).
constexpr const char* kSample =
    "The quick brown fox jumps over the lazy dog; it's 3.14159 km away, isn't it? "
    "def f(x):\n    return x * 2  # comment\n\n"
    "Numbers 1234567890 and -42, 1e10, 007.   Tabs\tand\r\nnewlines.\n"
    "naïve café résumé — Zürich «quoted» “curly” "
    "日本語の文章 中文句子 한국어 문장 Ελληνικά русский текст "
    "emoji 🙂🚀 👩‍💻 flag 🇩🇪 skin 👍🏽\n";

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

int RunTokenizerBench(const std::vector<std::string>& args) {
  std::string model_dir = "tests/data/tokenizers/llama3";
  std::string text_path;
  std::string json_path;
  int64_t bytes = 1 << 18;
  int64_t repeats = 5;
  FlagSet flags("fluxion bench tokenizer",
                "Times Encode (pre-token cache off and warm), Decode and streaming "
                "detokenization per token on one thread.");
  flags.String("model-dir", &model_dir,
               "model directory (its tokenizer.json, else the byte tokenizer; LoadTokenizer)");
  flags.String("text", &text_path, "UTF-8 text file to tokenize (default: a built-in mix)");
  flags.Int("bytes", &bytes, "text size when repeating the built-in mix");
  flags.Int("repeats", &repeats, "timed runs per measurement (median reported)");
  flags.String("json", &json_path, "also write results to this file");
  if (int rc = ParseFlagsOrExit(flags, args); rc >= 0) return rc;
  if (repeats < 1 || bytes < 1) {
    std::cerr << "error: --repeats and --bytes must be positive\n";
    return 2;
  }
  std::string text;
  if (!text_path.empty()) {
    std::ifstream in(text_path, std::ios::binary);
    if (!in) {
      std::cerr << "error: cannot read " << text_path << "\n";
      return 2;
    }
    std::stringstream s;
    s << in.rdbuf();
    text = s.str();
  } else {
    while (text.size() < static_cast<size_t>(bytes)) text += kSample;
  }

  std::vector<double> cold, warm, decode, stream, load;
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    auto tokenizer = model::LoadTokenizer(model_dir);
    if (!tokenizer.ok()) {
      std::cerr << "error: " << tokenizer.status() << "\n";
      return 2;
    }
    auto* hf = dynamic_cast<model::HfTokenizer*>(tokenizer->get());
    if (hf != nullptr) hf->set_cache_capacity(0);
    const auto t1 = std::chrono::steady_clock::now();
    auto first = (*tokenizer)->Encode(text);
    const auto t2 = std::chrono::steady_clock::now();
    if (hf != nullptr) {
      hf->set_cache_capacity(model::HfTokenizer::kDefaultCacheCapacity);
      (void)hf->Encode(text);  // fills the cache
    }
    const auto t2b = std::chrono::steady_clock::now();
    auto second = (*tokenizer)->Encode(text);
    const auto t3 = std::chrono::steady_clock::now();
    if (!first.ok() || !second.ok()) {
      std::cerr << "error: " << (first.ok() ? second.status() : first.status()) << "\n";
      return 2;
    }
    ids = std::move(*first);
    const std::string decoded = (*tokenizer)->Decode(ids, /*skip_special=*/false);
    const auto t4 = std::chrono::steady_clock::now();
    auto detokenizer = model::StreamDetokenizer::Create(tokenizer->get(), {});
    std::string streamed;
    for (int32_t id : ids) streamed += detokenizer->Add(id);
    streamed += detokenizer->Finish();
    const auto t5 = std::chrono::steady_clock::now();
    // A stream continues a text, so it keeps the leading space a SentencePiece-style decode of
    // a whole text drops (Tokenizer::leading_spaces_stripped).
    if ((*tokenizer)->StripDecodedStart(streamed) != decoded) {
      std::cerr << "error: streamed text differs from the full decode\n";
      return 1;
    }
    const double n = static_cast<double>(ids.size());
    load.push_back(Seconds(t1 - t0) * 1e3);
    cold.push_back(Seconds(t2 - t1) * 1e9 / n);
    warm.push_back(Seconds(t3 - t2b) * 1e9 / n);
    decode.push_back(Seconds(t4 - t3) * 1e9 / n);
    stream.push_back(Seconds(t5 - t4) * 1e9 / n);
  }
  const Stats l = Summarize(load), c = Summarize(cold), w = Summarize(warm), d = Summarize(decode),
              s = Summarize(stream);
  std::printf("tokenizer %s: %zu bytes -> %zu tokens (%.2f bytes/token), load %.1f ms\n",
              model_dir.c_str(), text.size(), ids.size(),
              static_cast<double>(text.size()) / static_cast<double>(ids.size()), l.median);
  std::printf("%-28s %10s %10s %10s\n", "ns per token", "median", "p10", "p90");
  std::printf("%-28s %10.1f %10.1f %10.1f\n", "encode, cache off", c.median, c.p10, c.p90);
  std::printf("%-28s %10.1f %10.1f %10.1f\n", "encode, warm cache", w.median, w.p10, w.p90);
  std::printf("%-28s %10.1f %10.1f %10.1f\n", "decode (whole text)", d.median, d.p10, d.p90);
  std::printf("%-28s %10.1f %10.1f %10.1f\n", "stream detokenize (per id)", s.median, s.p10, s.p90);
  if (!json_path.empty()) {
    nlohmann::json results = nlohmann::json::array();
    auto row = [&](const char* what, const Stats& st) {
      results.push_back({{"measure", what},
                         {"ns_per_token", st.median},
                         {"ns_per_token_p10", st.p10},
                         {"ns_per_token_p90", st.p90}});
    };
    row("encode_uncached", c);
    row("encode_warm", w);
    row("decode", d);
    row("stream_detokenize", s);
    nlohmann::json limits = {{"model_dir", model_dir},
                             {"text_bytes", text.size()},
                             {"tokens", ids.size()},
                             {"load_ms", l.median}};
    auto doc = ResultEnvelope(JoinCommand("fluxion bench tokenizer", args), limits, results);
    if (absl::Status st = WriteJson(json_path, doc); !st.ok()) {
      std::cerr << "error: " << st << "\n";
      return 1;
    }
    std::cout << "wrote " << json_path << "\n";
  }
  return 0;
}

}  // namespace fluxion::bench
