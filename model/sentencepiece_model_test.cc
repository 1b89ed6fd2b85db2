#include "model/sentencepiece_model.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "sentencepiece/model.pb.h"

namespace fluxion::model {
namespace {

using ::testing::HasSubstr;

std::string DataDir() {
  const char* src = std::getenv("FLUXION_SOURCE_DIR");
  return std::string(src ? src : ".") + "/tests/data/tokenizers/spm_bpe";
}

// tests/data/tokenizers/spm_bpe: a BPE tokenizer.model trained with Llama-2's options and
// SentencePiece 0.1.97's own ids and decodes (tools/hf_reference/make_spm_refs.py).
TEST(SentencePieceModelTest, EncodesAndDecodesAsSentencePieceItself) {
  auto tokenizer = LoadTokenizer(DataDir());  // no tokenizer.json there: the .model is read
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::ifstream in(DataDir() + "/references.json");
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json refs = nlohmann::json::parse(text.str());
  ASSERT_GE(refs["cases"].size(), 20u);
  for (const nlohmann::json& c : refs["cases"]) {
    const std::string t = c["text"].get<std::string>();
    SCOPED_TRACE(nlohmann::json(t).dump());
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    auto ids = (*tokenizer)->Encode(t);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, want);
    EXPECT_EQ((*tokenizer)->Decode(want, /*skip_special=*/true), c["decoded"].get<std::string>());
  }
  // The control pieces are special tokens, as in Hugging Face's converted tokenizers.
  const std::optional<int32_t> bos = (*tokenizer)->TokenToId("<s>");
  ASSERT_TRUE(bos.has_value());
  EXPECT_TRUE((*tokenizer)->IsSpecial(*bos));
  EXPECT_THAT(*(*tokenizer)->Encode("<s>"), ::testing::ElementsAre(*bos));
  // A user-defined piece is an added token, not special, cut out of the text wherever it is.
  const std::optional<int32_t> tool = (*tokenizer)->TokenToId("<|tool|>");
  ASSERT_TRUE(tool.has_value());
  EXPECT_FALSE((*tokenizer)->IsSpecial(*tool));
  auto with_tool = (*tokenizer)->Encode("call<|tool|>now");
  ASSERT_TRUE(with_tool.ok());
  EXPECT_EQ(std::count(with_tool->begin(), with_tool->end(), *tool), 1);
}

std::string ReferenceModel() {
  std::ifstream in(DataDir() + "/tokenizer.model", std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

void ExpectRefused(const sentencepiece::ModelProto& m, const std::string& part) {
  auto j = SentencePieceToTokenizerJson(m.SerializeAsString());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument) << part;
  EXPECT_THAT(j.status().message(), HasSubstr(part));
}

TEST(SentencePieceModelTest, WhatItDoesNotServeIsInvalidArgumentSayingWhat) {
  EXPECT_EQ(SentencePieceToTokenizerJson("not a model proto \xff\xff").status().code(),
            absl::StatusCode::kInvalidArgument);
  sentencepiece::ModelProto good;
  ASSERT_TRUE(good.ParseFromString(ReferenceModel()));
  ASSERT_TRUE(SentencePieceToTokenizerJson(good.SerializeAsString()).ok());
  sentencepiece::ModelProto m = good;
  m.mutable_trainer_spec()->set_model_type(sentencepiece::TrainerSpec::UNIGRAM);
  ExpectRefused(m, "UNIGRAM");
  m = good;
  m.mutable_normalizer_spec()->set_name("nmt_nfkc");
  m.mutable_normalizer_spec()->set_precompiled_charsmap("x");
  ExpectRefused(m, "nmt_nfkc");
  m = good;
  m.mutable_normalizer_spec()->set_remove_extra_whitespaces(true);
  ExpectRefused(m, "remove_extra_whitespaces");
  m = good;
  m.mutable_trainer_spec()->set_unk_id(m.pieces_size());
  ExpectRefused(m, "unk_id");
  m = good;
  m.mutable_pieces(5)->set_piece(m.pieces(4).piece());
  ExpectRefused(m, "piece 5");
  m = good;
  m.mutable_pieces(6)->set_piece(std::string("a\0\xff", 3));  // found by sentencepiece_model_fuzz
  ExpectRefused(m, "UTF-8");
}

}  // namespace
}  // namespace fluxion::model
