// The sparse policies inside the real decode loop (model::Generate with a decode-attention
// factory), on a random tiny model.
#include <filesystem>
#include <random>

#include <unistd.h>

#include "decode/step/sparse_attention.h"
#include "gtest/gtest.h"
#include "model/generator.h"
#include "model/random_model.h"

namespace fluxion::decode {
namespace {

class SparseGenerateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/sparse_generate_test_" + std::to_string(getpid());
    ASSERT_TRUE(model::WriteRandomModel(*model::PresetConfig("tiny"), 3, dir_).ok());
    model_ = std::move(*model::Model::Load(dir_));
    const auto shape = model_->attention_shape();
    arena_ = std::move(*KvArena::Create(KvShape{shape.num_layers, shape.num_kv_heads,
                                                shape.head_dim, 16}
                                            .page_bytes(),
                                        shape.num_layers * shape.num_kv_heads * 64));
    std::mt19937 rng(5);
    prompt_.resize(700);
    for (auto& t : prompt_) t = static_cast<int32_t>(rng() % 512);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  model::GenerationResult Run(const std::string& policy, double budget) {
    model::GenerationOptions opts;
    opts.max_tokens = 24;
    opts.ignore_eos = true;
    if (policy != "dense") {
      const auto config = *sparse::ParsePolicy(policy, budget);
      const auto shape = model_->attention_shape();
      opts.decode_attention = [this, config, shape](const model::DenseAttention& prefilled)
          -> absl::StatusOr<std::unique_ptr<model::SequenceAttention>> {
        auto a = SparseAttention::FromDense(arena_.get(), shape, 16, prefilled, config);
        if (!a.ok()) return a.status();
        return std::unique_ptr<model::SequenceAttention>(std::move(*a));
      };
    }
    auto result = model::Generate(*model_, prompt_, opts);
    EXPECT_TRUE(result.ok()) << result.status();
    return std::move(*result);
  }

  std::string dir_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<KvArena> arena_;
  std::vector<int32_t> prompt_;
};

TEST_F(SparseGenerateTest, FullPolicyOverPagesGivesTheSameTokensAsTheDenseCache) {
  // The pages hold bf16 K/V where the dense cache holds fp32; on this model and prompt that
  // rounding moves no greedy choice.
  EXPECT_EQ(Run("full", 1.0).tokens, Run("dense", 1.0).tokens);
}

TEST_F(SparseGenerateTest, SparsePoliciesRunInsideTheDecodeLoopAndReportTheirBudget) {
  for (const char* policy : {"exact_topk", "quest", "fixed_32_0.05", "lfps", "lfps_paper", "fluxion"}) {
    auto r = Run(policy, 0.1);
    EXPECT_EQ(r.tokens.size(), 24u) << policy;
    const auto& attention = dynamic_cast<const SparseAttention&>(r.sequence->attention());
    EXPECT_GT(attention.attended_fraction(), 0.0) << policy;
    EXPECT_LT(attention.attended_fraction(), 0.15) << policy;
  }
  EXPECT_EQ(arena_->counters().reserved, 0);
}

}  // namespace
}  // namespace fluxion::decode
