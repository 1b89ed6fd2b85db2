// Model::ForwardBatch against Model::Forward run on each sequence alone: the last token's logits
// and every layer's K/V rows must agree to 1e-5 relative, for batches of sequences of different
// lengths (1 token, a prompt that crosses the 512-row chunk, a sequence continuing a cache), one
// sequence dropping out mid-batch, and the validation errors naming the sequence.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <random>

#include <unistd.h>

#include "gtest/gtest.h"
#include "model/dense_attention.h"
#include "model/model.h"
#include "model/random_model.h"

namespace fluxion::model {
namespace {

constexpr double kRelTol = 1e-5;

std::vector<int32_t> RandomTokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// max |a - b| / max(1, max |b|).
double RelDiff(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 1;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / scale;
}

// A DenseAttention that fails at `fail_layer` of the first piece reaching it (as the prefill
// engine's cancellation check does).
class FailingAttention : public SequenceAttention {
 public:
  FailingAttention(const AttentionShape& shape, int fail_layer)
      : dense_(shape), fail_layer_(fail_layer) {}
  absl::Status Forward(int layer, int64_t pos0, int64_t n, const float* q, const float* k,
                       const float* v, float* out) override {
    if (layer == fail_layer_) return absl::CancelledError("cancelled by the test");
    return dense_.Forward(layer, pos0, n, q, k, v, out);
  }

 private:
  DenseAttention dense_;
  int fail_layer_;
};

class ModelBatchTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ModelConfig c = PresetConfig("tiny").value();
    if (GetParam() == "qwen2") {
      c.architecture = Architecture::kQwen2;
      c.qkv_bias = true;
      c.tie_word_embeddings = true;
      c.num_kv_heads = 1;
      c.rope = RopeConfig{RopeType::kDefault, 10000.0};
    }
    dir_ = ::testing::TempDir() + "/fluxion_model_batch_test_" + GetParam() + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name() + "_" +
           std::to_string(getpid());
    ASSERT_TRUE(WriteRandomModel(c, 11, dir_).ok());
    auto model = Model::Load(dir_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Runs `prompts` (after optional `prefixes` run alone with Forward) batched and alone, and
  // compares logits and K/V of every sequence.
  void ExpectBatchEqualsAlone(const std::vector<std::vector<int32_t>>& prompts,
                              const std::vector<std::vector<int32_t>>& prefixes = {}) {
    const size_t b = prompts.size();
    const ModelConfig& c = model_->config();
    const int64_t row = c.num_kv_heads * c.head_dim;
    std::vector<std::unique_ptr<Sequence>> batched, alone;
    std::vector<std::vector<float>> alone_logits(b);
    std::vector<float> scratch;
    for (size_t i = 0; i < b; ++i) {
      batched.push_back(model_->NewSequence());
      alone.push_back(model_->NewSequence());
      if (i < prefixes.size() && !prefixes[i].empty()) {
        ASSERT_TRUE(model_->Forward(*batched[i], prefixes[i], &scratch).ok());
        ASSERT_TRUE(model_->Forward(*alone[i], prefixes[i], &scratch).ok());
      }
      ASSERT_TRUE(model_->Forward(*alone[i], prompts[i], &alone_logits[i]).ok());
    }
    std::vector<Sequence*> ptrs;
    std::vector<absl::Span<const int32_t>> spans;
    for (size_t i = 0; i < b; ++i) {
      ptrs.push_back(batched[i].get());
      spans.push_back(prompts[i]);
    }
    std::vector<std::vector<float>> logits;
    std::vector<absl::Status> statuses;
    ASSERT_TRUE(model_->ForwardBatch(ptrs, spans, &logits, &statuses).ok());
    ASSERT_EQ(logits.size(), b);
    for (size_t i = 0; i < b; ++i) {
      ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i];
      EXPECT_EQ(batched[i]->length(), alone[i]->length()) << "sequence " << i;
      ASSERT_EQ(logits[i].size(), alone_logits[i].size());
      EXPECT_LE(RelDiff(logits[i].data(), alone_logits[i].data(), c.vocab_size), kRelTol)
          << "logits of sequence " << i << " (" << prompts[i].size() << " tokens)";
      const auto& db = static_cast<const DenseAttention&>(batched[i]->attention());
      const auto& da = static_cast<const DenseAttention&>(alone[i]->attention());
      for (int l = 0; l < c.num_layers; ++l) {
        ASSERT_EQ(db.length(l), da.length(l));
        EXPECT_LE(RelDiff(db.keys(l), da.keys(l), da.length(l) * row), kRelTol)
            << "keys of sequence " << i << " layer " << l;
        EXPECT_LE(RelDiff(db.values(l), da.values(l), da.length(l) * row), kRelTol)
            << "values of sequence " << i << " layer " << l;
      }
    }
  }

  std::string dir_;
  std::unique_ptr<Model> model_;
};

TEST_P(ModelBatchTest, TwoSequencesEqualForwardAlone) {
  const int64_t vocab = model_->config().vocab_size;
  ExpectBatchEqualsAlone({RandomTokens(37, vocab, 1), RandomTokens(1, vocab, 2)});
}

TEST_P(ModelBatchTest, ThreeSequencesIncludingOneLongerThanAChunk) {
  const int64_t vocab = model_->config().vocab_size;
  ExpectBatchEqualsAlone(
      {RandomTokens(600, vocab, 3), RandomTokens(1, vocab, 4), RandomTokens(130, vocab, 5)});
}

TEST_P(ModelBatchTest, FourSequencesSomeContinuingACache) {
  const int64_t vocab = model_->config().vocab_size;
  ExpectBatchEqualsAlone({RandomTokens(64, vocab, 6), RandomTokens(1, vocab, 7),
                          RandomTokens(513, vocab, 8), RandomTokens(9, vocab, 9)},
                         {{}, RandomTokens(20, vocab, 10), {}, RandomTokens(3, vocab, 11)});
}

TEST_P(ModelBatchTest, OneSequenceIsLikeForward) {
  ExpectBatchEqualsAlone({RandomTokens(77, model_->config().vocab_size, 12)});
}

TEST_P(ModelBatchTest, AFailingSequenceLeavesTheBatchAndTheOthersAreUnharmed) {
  const ModelConfig& c = model_->config();
  const auto p0 = RandomTokens(600, c.vocab_size, 13), p1 = RandomTokens(50, c.vocab_size, 14),
             p2 = RandomTokens(7, c.vocab_size, 15);
  auto s0 = model_->NewSequence(), s2 = model_->NewSequence();
  Sequence s1(std::make_unique<FailingAttention>(model_->attention_shape(), /*fail_layer=*/2));
  std::vector<Sequence*> ptrs = {s0.get(), &s1, s2.get()};
  std::vector<absl::Span<const int32_t>> spans = {p0, p1, p2};
  std::vector<std::vector<float>> logits;
  std::vector<absl::Status> statuses;
  ASSERT_TRUE(model_->ForwardBatch(ptrs, spans, &logits, &statuses).ok());
  EXPECT_TRUE(statuses[0].ok());
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(statuses[2].ok());
  EXPECT_TRUE(logits[1].empty());
  for (auto [seq, prompt, out] : {std::make_tuple(s0.get(), &p0, &logits[0]),
                                  std::make_tuple(s2.get(), &p2, &logits[2])}) {
    auto alone = model_->NewSequence();
    std::vector<float> want;
    ASSERT_TRUE(model_->Forward(*alone, *prompt, &want).ok());
    EXPECT_EQ(seq->length(), static_cast<int64_t>(prompt->size()));
    EXPECT_LE(RelDiff(out->data(), want.data(), c.vocab_size), kRelTol);
  }
}

TEST_P(ModelBatchTest, ValidationErrorsNameTheSequence) {
  const int64_t vocab = model_->config().vocab_size;
  auto a = model_->NewSequence(), b = model_->NewSequence();
  std::vector<Sequence*> ptrs = {a.get(), b.get()};
  const auto good = RandomTokens(5, vocab, 16);
  const std::vector<int32_t> empty, bad = {1, static_cast<int32_t>(vocab)};
  std::vector<std::vector<float>> logits;
  std::vector<absl::Status> statuses;
  std::vector<absl::Span<const int32_t>> spans = {good, empty};
  absl::Status s = model_->ForwardBatch(ptrs, spans, &logits, &statuses);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sequence 1"), std::string::npos) << s;
  spans = {bad, good};
  s = model_->ForwardBatch(ptrs, spans, &logits, &statuses);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sequence 0"), std::string::npos) << s;
  EXPECT_NE(s.message().find("vocabulary"), std::string::npos) << s;
  EXPECT_EQ(a->length(), 0);  // nothing computed
  std::vector<Sequence*> twice = {a.get(), a.get()};
  spans = {good, good};
  EXPECT_EQ(model_->ForwardBatch(twice, spans, &logits, &statuses).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model_->ForwardBatch({}, {}, &logits, &statuses).code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Families, ModelBatchTest, ::testing::Values("llama", "qwen2"));

}  // namespace
}  // namespace fluxion::model
