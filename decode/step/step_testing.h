// Test helpers shared by the step executors' tests (step_executor_test, ping_pong_step_executor
// _test): a tiny random model on disk, prompts prefilled on the dense cache, and requests built
// from them over host pages, as the decode node builds them. Test-only (gtest assertions inside).
#ifndef FLUXION_DECODE_STEP_STEP_TESTING_H_
#define FLUXION_DECODE_STEP_STEP_TESTING_H_

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "decode/kv/kv_arena.h"
#include "decode/step/sparse_attention.h"
#include "gtest/gtest.h"
#include "model/dense_attention.h"
#include "model/model.h"
#include "model/random_model.h"

namespace fluxion::decode::step_testing {

inline constexpr int64_t kPageTokens = 16;
inline constexpr int64_t kTailQueries = 32;  // what LFPS / Fluxion capture from the prefill

// The `tiny` preset with random weights from `seed`, written to a temporary directory that the
// destructor removes, and loaded.
class TinyModel {
 public:
  TinyModel(const std::string& name, uint64_t seed)
      : dir_(::testing::TempDir() + "/" + name + "_" + std::to_string(getpid())) {
    EXPECT_TRUE(model::WriteRandomModel(*model::PresetConfig("tiny"), seed, dir_).ok());
    model_ = std::move(*model::Model::Load(dir_));
  }
  ~TinyModel() { std::filesystem::remove_all(dir_); }
  const model::Model* get() const { return model_.get(); }

 private:
  std::string dir_;
  std::unique_ptr<model::Model> model_;
};

struct Prefill {
  std::unique_ptr<model::DenseAttention> cache;
  int32_t first_token = 0;
};

struct Request {
  std::unique_ptr<model::Sequence> seq;
  SparseAttention* attention = nullptr;
  int32_t token = 0;
};

// `n` random byte tokens.
inline std::vector<int32_t> Prompt(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (auto& t : p) t = static_cast<int32_t>(rng() % 256);
  return p;
}

// The prompt prefilled on the dense cache, recording its tail queries; its first token greedy.
inline Prefill MakePrefill(const model::Model& m, const std::vector<int32_t>& prompt) {
  Prefill p;
  auto dense = std::make_unique<model::DenseAttention>(m.attention_shape());
  const int64_t n = static_cast<int64_t>(prompt.size());
  dense->RecordQueries(std::max<int64_t>(0, n - kTailQueries), n);
  model::DenseAttention* raw = dense.get();
  model::Sequence seq(std::move(dense));
  std::vector<float> logits;
  EXPECT_TRUE(m.Forward(seq, prompt, &logits).ok());
  p.cache = std::make_unique<model::DenseAttention>(*raw);
  p.first_token =
      static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  return p;
}

// An arena of `pages` pages for the model's K/V.
inline std::unique_ptr<KvArena> MakeArena(const model::Model& m, int64_t pages = 8192) {
  const model::AttentionShape shape = m.attention_shape();
  return *KvArena::Create(
      KvShape{shape.num_layers, shape.num_kv_heads, shape.head_dim, kPageTokens}.page_bytes(),
      pages);
}

// `prefill` moved into pages of `arena` under `policy`.
inline Request MakeRequest(const model::Model& m, KvArena* arena, const Prefill& prefill,
                           const sparse::PolicyConfig& policy) {
  auto attention =
      SparseAttention::FromDense(arena, m.attention_shape(), kPageTokens, *prefill.cache, policy);
  EXPECT_TRUE(attention.ok()) << attention.status();
  Request r;
  r.attention = attention->get();
  r.seq = std::make_unique<model::Sequence>(std::move(*attention), prefill.cache->length(0));
  r.token = prefill.first_token;
  return r;
}

}  // namespace fluxion::decode::step_testing

#endif  // FLUXION_DECODE_STEP_STEP_TESTING_H_
